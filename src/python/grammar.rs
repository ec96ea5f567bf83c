//! `pagedkv._core.Vocabulary`, `Grammar` and `GrammarMatcher`: thin shells over
//! [`crate::grammar`]. Compiling releases the GIL; a matcher is one sequence's state, locked per
//! call.

use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArray2};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::errors::IntoPyResult;
use super::sync::detached;
use crate::error::Error;
use crate::grammar::{
    prepared_json_schema, Grammar, GrammarSpec, Matcher, PendingMasks, SharedMatcher, Vocabulary,
};

/// A tokenizer's tokens as bytes (``tokens[id]``), which of them are special (stand for no
/// text), and its end-of-sequence id: what grammars are compiled against.
#[pyclass(name = "Vocabulary", module = "pagedkv", frozen)]
pub struct PyVocabulary {
    inner: Arc<Vocabulary>,
}

#[pymethods]
impl PyVocabulary {
    #[new]
    #[pyo3(signature = (tokens, special, eos_token_id))]
    fn new(
        py: Python<'_>,
        tokens: Vec<Vec<u8>>,
        special: Vec<bool>,
        eos_token_id: u32,
    ) -> PyResult<Self> {
        let inner = detached(py, || Vocabulary::new(&tokens, &special, eos_token_id))?;
        Ok(PyVocabulary {
            inner: Arc::new(inner),
        })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// A grammar compiled for a vocabulary, from exactly one of ``json_schema`` (JSON text),
/// ``regex``, ``lark`` (llguidance's Lark dialect, start rule ``start``) or ``choice`` (strings).
/// A grammar that does not compile, or matches no output, is ``InvalidArgumentError``.
#[pyclass(name = "Grammar", module = "pagedkv", frozen)]
pub struct PyGrammar {
    inner: Arc<Mutex<Grammar>>,
}

#[pymethods]
impl PyGrammar {
    #[new]
    #[pyo3(signature = (vocabulary, *, json_schema=None, regex=None, lark=None, choice=None))]
    fn new(
        py: Python<'_>,
        vocabulary: &PyVocabulary,
        json_schema: Option<String>,
        regex: Option<String>,
        lark: Option<String>,
        choice: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let specs: Vec<GrammarSpec> = [
            json_schema.map(GrammarSpec::JsonSchema),
            regex.map(GrammarSpec::Regex),
            lark.map(GrammarSpec::Lark),
            choice.map(GrammarSpec::Choice),
        ]
        .into_iter()
        .flatten()
        .collect();
        let [spec] = <[GrammarSpec; 1]>::try_from(specs).map_err(|specs| {
            PyTypeError::new_err(format!(
                "Grammar takes exactly one of json_schema, regex, lark or choice, got {}",
                specs.len()
            ))
        })?;
        let vocabulary = vocabulary.inner.clone();
        let grammar = detached(py, || Grammar::compile(&vocabulary, &spec))?;
        Ok(PyGrammar {
            inner: Arc::new(Mutex::new(grammar)),
        })
    }

    /// A matcher at the start of an output.
    fn matcher(&self) -> PyGrammarMatcher {
        let grammar = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        PyGrammarMatcher {
            inner: Arc::new(Mutex::new(grammar.matcher())),
        }
    }
}

/// One output's position in a grammar: which tokens may come next, and advancing past one.
#[pyclass(name = "GrammarMatcher", module = "pagedkv", frozen)]
pub struct PyGrammarMatcher {
    inner: SharedMatcher,
}

impl PyGrammarMatcher {
    fn with<T>(&self, f: impl FnOnce(&mut Matcher) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[pymethods]
impl PyGrammarMatcher {
    /// A bool array over the vocabulary: the tokens that may come next (only the
    /// end-of-sequence token once the output is complete and cannot go on).
    fn allowed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let (words, size) = self
            .with(|m| {
                let mut words = vec![0u32; m.len().div_ceil(32)];
                m.allowed(&mut words).map(|()| (words, m.len()))
            })
            .py_err()?;
        let bits: Vec<bool> = (0..size)
            .map(|t| words[t / 32] & (1 << (t % 32)) != 0)
            .collect();
        Ok(PyArray1::from_vec(py, bits))
    }

    /// Moves past ``token``; ``InvalidArgumentError`` (nothing changed) if it may not come next.
    fn advance(&self, token: u32) -> PyResult<()> {
        self.with(|m| m.advance(token)).py_err()
    }

    /// Whether the output so far is complete.
    #[getter]
    fn is_accepting(&self) -> bool {
        self.with(|m| m.is_accepting())
    }

    /// Whether the grammar allows nothing more.
    #[getter]
    fn is_finished(&self) -> bool {
        self.with(|m| m.is_finished())
    }
}

/// Starts computing the masks of ``matchers`` (one vocabulary) on the worker pool, returning at
/// once: the caller runs the forward pass meanwhile and collects them with ``wait``.
#[pyfunction]
pub fn start_masks(matchers: Vec<PyRef<'_, PyGrammarMatcher>>) -> PyResult<PyPendingMasks> {
    let shared = matchers.iter().map(|m| Arc::clone(&m.inner)).collect();
    let pending = PendingMasks::start(shared).py_err()?;
    Ok(PyPendingMasks {
        inner: Mutex::new(Some(pending)),
    })
}

/// Masks being computed (``start_masks``).
#[pyclass(name = "PendingMasks", module = "pagedkv", frozen)]
pub struct PyPendingMasks {
    inner: Mutex<Option<PendingMasks>>,
}

#[pymethods]
impl PyPendingMasks {
    /// Blocks (the GIL released) until every mask is ready: a uint32 array ``[rows, ceil(vocab /
    /// 32)]`` (bit ``t % 32`` of word ``t / 32`` set when token ``t`` may come), and each row's
    /// error (None, or why its grammar failed: its mask is then all zero), and the seconds spent
    /// computing them (summed over rows). Once only.
    #[allow(clippy::type_complexity)]
    fn wait<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyArray2<u32>>, Vec<Option<String>>, f64)> {
        let pending = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| Error::InvalidArgument("these masks were already collected".into()))
            .py_err()?;
        let masks = detached(py, || pending.wait())?;
        let rows = masks.errors.len();
        let array = numpy::ndarray::Array2::from_shape_vec((rows, masks.words), masks.bits)
            .expect("rows × words bits");
        Ok((
            PyArray2::from_owned_array(py, array),
            masks.errors,
            masks.seconds,
        ))
    }
}

/// A JSON schema (JSON text) as grammars compile it, as JSON text: what to embed in a Lark
/// grammar's ``%json`` so that it holds the same output as a ``json_schema`` constraint.
/// ``InvalidArgumentError`` for text that is not JSON.
#[pyfunction(name = "prepared_json_schema")]
pub fn py_prepared_json_schema(schema: &str) -> PyResult<String> {
    prepared_json_schema(schema)
        .map(|value| value.to_string())
        .map_err(|e| Error::InvalidArgument(format!("the JSON schema is not JSON: {e}")))
        .py_err()
}
