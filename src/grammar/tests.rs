use super::*;
use std::sync::{Arc, Mutex};

/// Every byte, a few multi-byte tokens, and a special end-of-sequence token (the last).
fn vocabulary() -> (Vocabulary, Vec<Vec<u8>>, u32) {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for word in [
        "ab", "abc", "no", "yes", "ma", "aybe", "{\"", "\":", "true", "ye",
    ] {
        tokens.push(word.as_bytes().to_vec());
    }
    tokens.push(b"</s>".to_vec());
    let eos = tokens.len() as u32 - 1;
    let special: Vec<bool> = (0..tokens.len()).map(|t| t as u32 == eos).collect();
    (
        Vocabulary::new(&tokens, &special, eos).unwrap(),
        tokens,
        eos,
    )
}

fn allowed_set(mask: &[u32], size: usize) -> Vec<u32> {
    (0..size as u32)
        .filter(|&t| mask[t as usize / 32] & (1 << (t % 32)) != 0)
        .collect()
}

/// Walks `spec` choosing the allowed token `pick` selects at every step, checking each mask
/// against the brute force over `language` (finite): a token may come next when the output
/// with its bytes is a prefix of a member; end of sequence when the output is a member.
fn walk(spec: GrammarSpec, language: &[&str], pick: fn(&[u32]) -> u32) -> String {
    let (vocab, tokens, eos) = vocabulary();
    let grammar = Grammar::compile(&vocab, &spec).unwrap();
    let mut matcher = grammar.matcher();
    let mut output: Vec<u8> = Vec::new();
    let mut mask = vec![0u32; vocab.mask_words()];
    for _ in 0..64 {
        matcher.allowed(&mut mask).unwrap();
        let got = allowed_set(&mask, vocab.len());
        let want: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&t| {
                if t == eos {
                    return language.iter().any(|m| m.as_bytes() == output.as_slice());
                }
                let next = [output.as_slice(), &tokens[t as usize]].concat();
                language.iter().any(|m| m.as_bytes().starts_with(&next))
            })
            .collect();
        assert_eq!(
            got,
            want,
            "{spec:?} after {:?}",
            String::from_utf8_lossy(&output)
        );
        let token = pick(&got);
        if token == eos {
            return String::from_utf8(output).unwrap();
        }
        matcher.advance(token).unwrap();
        output.extend_from_slice(&tokens[token as usize]);
    }
    panic!("{spec:?} did not end");
}

fn largest(allowed: &[u32]) -> u32 {
    *allowed.last().unwrap()
}

fn smallest(allowed: &[u32]) -> u32 {
    allowed[0]
}

#[test]
fn masks_equal_the_brute_force_over_the_vocabulary() {
    let choice = GrammarSpec::Choice(vec!["yes".into(), "no".into(), "maybe".into()]);
    for pick in [largest, smallest] {
        let out = walk(choice.clone(), &["yes", "no", "maybe"], pick);
        assert!(["yes", "no", "maybe"].contains(&out.as_str()));
    }
    let language = ["ab", "ac", "abb", "abc", "acb", "acc"];
    for pick in [largest, smallest] {
        let out = walk(GrammarSpec::Regex("a(b|c){1,2}".into()), &language, pick);
        assert!(language.contains(&out.as_str()));
    }
    let lark = GrammarSpec::Lark(r#"start: "x" ("y" | "ye")"#.into());
    walk(lark, &["xy", "xye"], largest);
}

#[test]
fn a_json_schema_output_parses_and_validates() {
    let schema = r#"{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}"#;
    let (vocab, tokens, eos) = vocabulary();
    let grammar = Grammar::compile(&vocab, &GrammarSpec::JsonSchema(schema.into())).unwrap();
    for pick in [largest as fn(&[u32]) -> u32, smallest] {
        let mut matcher = grammar.matcher();
        let mut mask = vec![0u32; vocab.mask_words()];
        let mut output = Vec::new();
        loop {
            matcher.allowed(&mut mask).unwrap();
            let allowed = allowed_set(&mask, vocab.len());
            // Prefer ending; else the pick among the others (the whitespace is fixed: no loop).
            let text: Vec<u32> = allowed.iter().copied().filter(|&t| t != eos).collect();
            if allowed.contains(&eos) || text.is_empty() {
                break;
            }
            let token = pick(&text);
            matcher.advance(token).unwrap();
            output.extend_from_slice(&tokens[token as usize]);
            assert!(output.len() < 200, "{}", String::from_utf8_lossy(&output));
        }
        let value: serde_json::Value = serde_json::from_slice(&output).unwrap();
        assert!(
            value["ok"].is_boolean() && value.as_object().unwrap().len() == 1,
            "{value}"
        );
    }
}

#[test]
fn bad_grammars_and_tokens_are_typed_errors_and_change_nothing() {
    let (vocab, _, eos) = vocabulary();
    for spec in [
        GrammarSpec::JsonSchema("{not json".into()),
        GrammarSpec::JsonSchema(r#"{"type": "no such type"}"#.into()),
        GrammarSpec::Regex("a(".into()),
        GrammarSpec::Lark("start: undefined_rule".into()),
        GrammarSpec::Choice(vec![]),
        // An empty language: a string of at least 2 characters and at most 1.
        GrammarSpec::JsonSchema(r#"{"type": "string", "minLength": 2, "maxLength": 1}"#.into()),
    ] {
        assert!(
            matches!(
                Grammar::compile(&vocab, &spec),
                Err(Error::InvalidArgument(_))
            ),
            "{spec:?}"
        );
    }
    assert!(Vocabulary::new(&[b"a".to_vec()], &[false], 1).is_err());
    assert!(Vocabulary::new(&[b"a".to_vec()], &[], 0).is_err());
    let grammar = Grammar::compile(&vocab, &GrammarSpec::Regex("ab".into())).unwrap();
    let mut matcher = grammar.matcher();
    let mut before = vec![0u32; vocab.mask_words()];
    matcher.allowed(&mut before).unwrap();
    assert!(matcher.advance(b'z' as u32).is_err());
    assert!(matcher.advance(eos + 1).is_err());
    assert!(matcher.allowed(&mut [0u32; 1]).is_err());
    let mut after = vec![0u32; vocab.mask_words()];
    matcher.allowed(&mut after).unwrap();
    assert_eq!(before, after);
    matcher.advance(b'a' as u32).unwrap();
    matcher.advance(b'b' as u32).unwrap();
    assert!(matcher.is_accepting());
    matcher.allowed(&mut after).unwrap();
    assert_eq!(allowed_set(&after, vocab.len()), vec![eos]);
}

#[test]
fn pending_masks_equal_each_matchers_own_mask_and_keep_rows_in_order() {
    let (vocab, _, _) = vocabulary();
    let choice = Grammar::compile(
        &vocab,
        &GrammarSpec::Choice(vec!["yes".into(), "no".into()]),
    )
    .unwrap();
    let digits = Grammar::compile(&vocab, &GrammarSpec::Regex("[0-9]{2,3}".into())).unwrap();
    let matchers: Vec<SharedMatcher> = (0..9)
        .map(|i| {
            let mut m = if i % 2 == 0 {
                choice.matcher()
            } else {
                digits.matcher()
            };
            if i % 4 == 1 {
                m.advance(b'7' as u32).unwrap(); // some rows mid-output
            }
            Arc::new(Mutex::new(m))
        })
        .collect();
    let masks = PendingMasks::start(matchers.clone())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(masks.words, vocab.mask_words());
    assert_eq!(masks.bits.len(), 9 * masks.words);
    for (row, matcher) in matchers.iter().enumerate() {
        let mut own = vec![0u32; vocab.mask_words()];
        matcher.lock().unwrap().allowed(&mut own).unwrap();
        assert_eq!(
            &masks.bits[row * masks.words..][..masks.words],
            &own[..],
            "row {row}"
        );
        assert_eq!(masks.errors[row], None);
    }
    let empty = PendingMasks::start(Vec::new()).unwrap().wait().unwrap();
    assert!(empty.bits.is_empty() && empty.errors.is_empty());
}

#[test]
fn pending_masks_refuse_matchers_of_different_vocabularies() {
    let (vocab, _, _) = vocabulary();
    let small = Vocabulary::new(&[b"a".to_vec(), b"</s>".to_vec()], &[false, true], 1).unwrap();
    let spec = GrammarSpec::Regex("a+".into());
    let matchers: Vec<SharedMatcher> = [&vocab, &small]
        .into_iter()
        .map(|v| Arc::new(Mutex::new(Grammar::compile(v, &spec).unwrap().matcher())))
        .collect();
    assert!(matches!(
        PendingMasks::start(matchers),
        Err(Error::Shape(_))
    ));
}

#[test]
fn objects_listing_properties_allow_no_others_unless_the_schema_says_so() {
    let mut schema = serde_json::json!({
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "list": {"type": "array", "items": {"properties": {"b": {}}}},
            "open": {"properties": {"c": {}}, "additionalProperties": true},
        },
        "$defs": {"node": {"properties": {"e": {}}}, "mixed": {"properties": {"f": {}}, "anyOf": [{"properties": {"g": {}}}]},
                  "union": {"anyOf": [{"properties": {"h": {}}}, {"properties": {"i": {}}}]}},
        "enum": [{"properties": {}}],
    });
    close_objects(&mut schema);
    let closed = |pointer: &str| schema.pointer(pointer).cloned();
    let no = Some(serde_json::Value::Bool(false));
    assert_eq!(closed("/additionalProperties"), no);
    assert_eq!(closed("/properties/properties/additionalProperties"), no);
    assert_eq!(closed("/properties/list/items/additionalProperties"), no);
    // Alternatives beside properties name some of them: neither they nor the object are closed;
    // the alternatives of a plain anyOf (a tagged union) are.
    assert_eq!(closed("/$defs/mixed/anyOf/0/additionalProperties"), None);
    assert_eq!(closed("/$defs/mixed/additionalProperties"), None);
    assert_eq!(closed("/$defs/union/anyOf/1/additionalProperties"), no);
    assert_eq!(closed("/$defs/node/additionalProperties"), no);
    assert_eq!(
        closed("/properties/open/additionalProperties"),
        Some(true.into())
    );
    // A property named "properties" is a property, and an enum's values are values: untouched.
    assert_eq!(closed("/properties/additionalProperties"), None);
    assert_eq!(closed("/enum/0/additionalProperties"), None);
}

#[test]
fn the_parts_of_an_all_of_stay_open_and_the_schema_matches_their_union() {
    let (vocab, _, _) = vocabulary();
    let schema = serde_json::json!({
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer", "properties": {}}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {}}}}, "required": ["b"]},
        ],
    });
    let mut closed = schema.clone();
    close_objects(&mut closed);
    assert_eq!(closed.pointer("/allOf/0/additionalProperties"), None);
    // Below a part, objects are closed as anywhere else.
    assert_eq!(
        closed.pointer("/allOf/1/properties/b/additionalProperties"),
        Some(&serde_json::Value::Bool(false))
    );
    // Closing each part would have made {a} ∧ {b} empty: it compiles.
    Grammar::compile(&vocab, &GrammarSpec::JsonSchema(schema.to_string())).unwrap();
}
