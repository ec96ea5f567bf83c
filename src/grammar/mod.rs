//! Constrained decoding: which tokens of the vocabulary keep an output inside a grammar (a JSON
//! schema, a regex, a Lark grammar or a fixed set of choices), computed by llguidance over the
//! tokenizer's byte strings.
//!
//! Invariants:
//! - A [`Vocabulary`] is the tokenizer's byte string per token id (special tokens marked), built
//!   once per model; every [`Grammar`] and [`Matcher`] of it masks exactly `len()` tokens.
//! - A [`Grammar`] is compiled once (a bad one is `InvalidArgument` naming the problem, before
//!   any state exists) and shared; each sequence has its own [`Matcher`], a copy of the
//!   compiled parser that advances on the tokens the sequence produces.
//! - [`Matcher::allowed`] writes a bitmask (bit `t % 32` of word `t / 32` set when token `t` may
//!   come next); a matcher that has finished allows only end of sequence. [`Matcher::advance`]
//!   refuses a token the mask did not allow, and leaves the matcher as it was.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher as LlgMatcher, ParserFactory};

use crate::error::{Error, Result};

mod masks;
pub use masks::{Masks, PendingMasks, SharedMatcher};

/// A tokenizer's tokens as bytes, with its end-of-sequence token.
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    size: usize,
}

impl Vocabulary {
    /// `tokens[id]` is token `id`'s bytes; `special[id]` marks the tokens that stand for no text
    /// (they are never produced inside a grammar's output). `eos` ends a finished output.
    pub fn new(tokens: &[Vec<u8>], special: &[bool], eos: u32) -> Result<Self> {
        let size = tokens.len();
        if size == 0 || special.len() != size || eos as usize >= size {
            return Err(Error::InvalidArgument(format!(
                "a vocabulary needs tokens, one special flag per token and an eos among them: {size} \
                 tokens, {} flags, eos {eos}",
                special.len()
            )));
        }
        let words: Vec<Vec<u8>> = tokens
            .iter()
            .zip(special)
            .map(|(bytes, &special)| {
                if special {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], bytes].concat()
                } else {
                    bytes.clone()
                }
            })
            .collect();
        let info = TokRxInfo::new(size as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::InvalidArgument(format!("the vocabulary cannot be used: {e}")))?;
        Ok(Vocabulary {
            factory: Arc::new(factory),
            size,
        })
    }

    /// Tokens in the vocabulary.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false: a vocabulary holds at least one token.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Words of a bitmask over the vocabulary.
    pub fn mask_words(&self) -> usize {
        self.size.div_ceil(32)
    }
}

/// What an output must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GrammarSpec {
    /// A JSON schema, as JSON text, compiled as [`prepared_json_schema`] prepares it.
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect), its start rule `start`.
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// A JSON schema (JSON text) as it is compiled, here and inside a Lark grammar's `%json` blocks
/// (a tool call's arguments): its objects closed ([`close_objects`]) and, unless its `x-guidance`
/// object sets llguidance's JSON options itself, its output on one line with ", " between items
/// and ": " after keys. With llguidance's default (any whitespace) the tiny random model wrote
/// tabs and newlines until its length limit, never closing a brace.
pub fn prepared_json_schema(
    text: &str,
) -> std::result::Result<serde_json::Value, serde_json::Error> {
    let mut schema: serde_json::Value = serde_json::from_str(text)?;
    close_objects(&mut schema);
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    Ok(schema)
}

/// Makes every object schema that lists `properties` and says nothing of `additionalProperties`
/// allow no others, as xgrammar's strict mode (vLLM's default backend) does. JSON Schema would
/// allow any: Gemma 3 270M, asked for {city, population, landmarks}, wrote those and then "area",
/// "climate", "climate"… until its 200-token limit, in both of two runs. A schema saying
/// `additionalProperties` (true, or a schema) keeps it.
///
/// Not closed: an object whose properties siblings may add to (`allOf`, `anyOf`, `oneOf`, `$ref`
/// beside its `properties`), nor the parts of an `allOf`, nor the alternatives beside an object's
/// own `properties` (each names part of one object's properties: closing each would refuse the
/// others', and the schema would match nothing). The alternatives of a plain `anyOf`/`oneOf`
/// (a tagged union) are whole objects, and closed.
fn close_objects(schema: &mut serde_json::Value) {
    close_objects_below(schema, true);
}

fn close_objects_below(schema: &mut serde_json::Value, close_here: bool) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let extended = ["allOf", "anyOf", "oneOf", "$ref"]
        .iter()
        .any(|k| object.contains_key(*k));
    let has_properties = object.contains_key("properties");
    if close_here && !extended && has_properties && !object.contains_key("additionalProperties") {
        object.insert(
            "additionalProperties".into(),
            serde_json::Value::Bool(false),
        );
    }
    // Only the keywords whose values are schemas (a property may be named "properties").
    for (keyword, value) in object.iter_mut() {
        match keyword.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Some(map) = value.as_object_mut() {
                    map.values_mut().for_each(close_objects);
                }
            }
            // Parts of one object, or alternatives beside properties of their own: both name
            // only some of the object's properties.
            "allOf" | "anyOf" | "oneOf" if keyword == "allOf" || has_properties => {
                if let Some(list) = value.as_array_mut() {
                    list.iter_mut()
                        .for_each(|part| close_objects_below(part, false));
                }
            }
            "anyOf" | "oneOf" | "prefixItems" => {
                if let Some(list) = value.as_array_mut() {
                    list.iter_mut().for_each(close_objects);
                }
            }
            "items" => match value {
                serde_json::Value::Array(list) => list.iter_mut().for_each(close_objects),
                other => close_objects(other),
            },
            "additionalProperties"
            | "additionalItems"
            | "unevaluatedProperties"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "propertyNames" => close_objects(value),
            _ => {}
        }
    }
}

/// A grammar compiled against a vocabulary, shared by the matchers of every sequence using it.
pub struct Grammar {
    parser: llguidance::TokenParser,
    size: usize,
}

impl Grammar {
    /// Compiles `spec` for `vocabulary`; `InvalidArgument` names what is wrong with it.
    pub fn compile(vocabulary: &Vocabulary, spec: &GrammarSpec) -> Result<Self> {
        let invalid = |what: &str, e: &dyn std::fmt::Display| {
            Error::InvalidArgument(format!("the {what} does not compile: {e}"))
        };
        let (what, grammar) = match spec {
            GrammarSpec::JsonSchema(text) => {
                let schema = prepared_json_schema(text).map_err(|e| invalid("JSON schema", &e))?;
                ("JSON schema", TopLevelGrammar::from_json_schema(schema))
            }
            GrammarSpec::Regex(rx) => ("regex", TopLevelGrammar::from_regex(rx)),
            GrammarSpec::Lark(text) => ("Lark grammar", TopLevelGrammar::from_lark(text.clone())),
            GrammarSpec::Choice(options) => {
                if options.is_empty() {
                    return Err(Error::InvalidArgument(
                        "a choice needs at least one option".into(),
                    ));
                }
                // Each option a Lark string literal (JSON's escaping is Lark's).
                let literals: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).expect("a string serialises"))
                    .collect();
                let lark = format!("start: {}", literals.join(" | "));
                ("choice", TopLevelGrammar::from_lark(lark))
            }
        };
        let parser = vocabulary
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(what, &e))?;
        let grammar = Grammar {
            parser,
            size: vocabulary.size,
        };
        // A grammar whose language is empty allows no first token: refused here, not mid-request.
        let mut probe = grammar.matcher();
        let mut mask = vec![0u32; vocabulary.mask_words()];
        probe.allowed(&mut mask).map_err(|e| invalid(what, &e))?;
        if mask.iter().all(|&w| w == 0) {
            return Err(Error::InvalidArgument(format!(
                "the {what} matches no output"
            )));
        }
        Ok(grammar)
    }

    /// A fresh matcher at the start of an output.
    pub fn matcher(&self) -> Matcher {
        Matcher {
            inner: LlgMatcher::new(Ok(self.parser.deep_clone())),
            size: self.size,
        }
    }
}

/// One sequence's position in a grammar.
pub struct Matcher {
    inner: LlgMatcher,
    size: usize,
}

impl Matcher {
    /// Tokens in the vocabulary (bits of a mask).
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false: a vocabulary holds at least one token.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Writes into `mask` (`⌈len / 32⌉` words) the tokens that may come next.
    pub fn allowed(&mut self, mask: &mut [u32]) -> Result<()> {
        let words = self.size.div_ceil(32);
        if mask.len() != words {
            return Err(Error::Shape(format!(
                "a mask of {} words for {} tokens needs {words}",
                mask.len(),
                self.size
            )));
        }
        let vob = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| Error::InvalidArgument(format!("the grammar failed: {e}")))?;
        let bits = vob.as_slice();
        mask.copy_from_slice(&bits[..words]);
        // Bits past the vocabulary (llguidance rounds its sets up) are never set.
        if !self.size.is_multiple_of(32) {
            mask[words - 1] &= (1u32 << (self.size % 32)) - 1;
        }
        Ok(())
    }

    /// Moves past `token`; `InvalidArgument` (the matcher unchanged) if the grammar does not
    /// allow it here.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        if token as usize >= self.size {
            return Err(Error::InvalidArgument(format!(
                "token {token} is outside the vocabulary of {}",
                self.size
            )));
        }
        // One validation of this token, not a mask over the vocabulary: advancing runs once per
        // token of every constrained sequence.
        let consumed = self
            .inner
            .try_consume_tokens(&[token])
            .map_err(|e| Error::InvalidArgument(format!("the grammar failed: {e}")))?;
        if consumed == 0 {
            return Err(Error::InvalidArgument(format!(
                "token {token} does not continue the grammar here"
            )));
        }
        Ok(())
    }

    /// Whether the output so far is complete (end of sequence is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar allows nothing more (the output has ended).
    pub fn is_finished(&self) -> bool {
        self.inner.is_stopped()
    }
}

#[cfg(test)]
mod tests;
