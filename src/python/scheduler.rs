//! `pagedkv.Scheduler`, its step output `SchedulerOutput` and update result `UpdateOutput`.
//!
//! A step's arrays are moved out of the core into numpy arrays that own them (no copy); request
//! ids are turned into Python lists only when read.

use std::sync::{Arc, Mutex};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::args::{invalid, non_negative, positive, token_ids};
use super::errors::IntoPyResult;
use crate::scheduler::{
    FinishReason, Policy, RequestOptions, SamplingParams, Scheduler, SchedulerConfig, StepOutput,
    UpdateOutput, DEFAULT_ADMISSION_LOOKAHEAD_TOKENS,
};

/// Continuous-batching scheduler over a paged KV cache. Thread-safe; `schedule` and `update`
/// release the GIL.
#[pyclass(name = "Scheduler", module = "pagedkv", frozen)]
pub struct PyScheduler {
    inner: Mutex<Scheduler>,
}

impl PyScheduler {
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Scheduler) -> T + Send) -> T {
        py.detach(|| {
            f(&mut self
                .inner
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()))
        })
    }
}

fn strings<'py>(py: Python<'py>, ids: &[Arc<str>]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ids.iter().map(|id| &**id))
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
        max_model_len=None, enable_prefix_caching=true, policy="fcfs", aging_steps=100,
        long_prefill_token_threshold=0, eos_token_ids=None,
        admission_lookahead_tokens=Some(DEFAULT_ADMISSION_LOOKAHEAD_TOKENS as i64),
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        max_model_len: Option<i64>,
        enable_prefix_caching: bool,
        policy: &str,
        aging_steps: i64,
        long_prefill_token_threshold: i64,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        admission_lookahead_tokens: Option<i64>,
    ) -> PyResult<Self> {
        let mut config = SchedulerConfig::new(
            positive(num_blocks, "num_blocks")?,
            positive(block_size, "block_size")?,
        );
        config.max_num_seqs = positive(max_num_seqs, "max_num_seqs")?;
        config.max_num_batched_tokens = positive(max_num_batched_tokens, "max_num_batched_tokens")?;
        if let Some(len) = max_model_len {
            config.max_model_len = positive(len, "max_model_len")?;
        }
        config.enable_prefix_caching = enable_prefix_caching;
        config.policy = match policy {
            "fcfs" => Policy::Fcfs,
            "priority" => Policy::Priority {
                aging_steps: positive(aging_steps, "aging_steps")? as u64,
            },
            other => {
                return Err(invalid(format!(
                    "policy must be 'fcfs' or 'priority', not {other:?}"
                )))
            }
        };
        config.long_prefill_token_threshold =
            non_negative(long_prefill_token_threshold, "long_prefill_token_threshold")? as usize;
        config.eos_token_ids = eos_token_ids
            .map(|t| token_ids(t, "eos_token_ids"))
            .transpose()?
            .unwrap_or_default();
        config.admission_lookahead_tokens = admission_lookahead_tokens
            .map(|t| non_negative(t, "admission_lookahead_tokens"))
            .transpose()?
            .map(|t| t as usize);
        Ok(PyScheduler {
            inner: Mutex::new(Scheduler::new(config).py_err()?),
        })
    }

    /// Queues a request. Raises DuplicateSequenceError for a live id, InvalidArgumentError for an
    /// empty prompt, a prompt leaving no room within max_model_len, or bad limits; nothing changes then.
    #[pyo3(signature = (
        request_id, prompt_token_ids, max_tokens=16, stop_token_ids=None, ignore_eos=false,
        priority=0, arrival_time=None, cache_salt=None, n=1,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        priority: i64,
        arrival_time: Option<f64>,
        cache_salt: Option<String>,
        n: i64,
    ) -> PyResult<()> {
        let prompt = token_ids(prompt_token_ids, "prompt_token_ids")?;
        let params = SamplingParams {
            max_tokens: positive(max_tokens, "max_tokens")?,
            stop_token_ids: stop_token_ids
                .map(|s| token_ids(s, "stop_token_ids"))
                .transpose()?
                .unwrap_or_default(),
            ignore_eos,
            n: positive(n, "n")?,
        };
        let arrival_time = arrival_time.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        });
        let options = RequestOptions {
            priority,
            arrival_time,
            cache_salt: cache_salt.map(String::into_bytes),
        };
        self.with(py, |s| s.add_request(request_id, prompt, params, options))
            .py_err()
    }

    /// Drops a request in any state and frees its blocks. Raises UnknownSequenceError if it is
    /// not waiting or running.
    fn abort(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        self.with(py, |s| s.abort(request_id)).py_err()
    }

    /// Builds the next step (see SchedulerOutput). The previous step must have been updated.
    fn schedule(&self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let out = self
            .with(py, |s| {
                s.schedule()?;
                Ok(s.take_step_output())
            })
            .py_err()?;
        Ok(PySchedulerOutput::new(out))
    }

    /// Appends `sampled_token_ids[k]` (one per sample, i.e. per `output.logits_indices[k]`) and
    /// finishes sequences; returns what was produced. Raises ShapeError for a wrong length and
    /// InvalidArgumentError for an output that is not the step awaiting update.
    fn update(
        &self,
        py: Python<'_>,
        output: &PySchedulerOutput,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<PyUpdateOutput> {
        let sampled = token_ids(sampled_token_ids, "sampled_token_ids")?;
        let step = output.step;
        let result = self.with(py, |s| {
            if s.pending_step() != Some(step) {
                return Err(crate::Error::InvalidArgument(format!(
                    "output of step {step} is not the step awaiting update ({:?})",
                    s.pending_step()
                )));
            }
            s.update(&sampled)?;
            Ok(s.take_update_output())
        });
        Ok(PyUpdateOutput {
            inner: result.py_err()?,
        })
    }

    /// Whether any request is waiting or running.
    fn has_unfinished(&self, py: Python<'_>) -> bool {
        self.with(py, |s| s.has_unfinished())
    }

    /// Prompt plus output so far of sample `seq_index` of a live request.
    #[pyo3(signature = (request_id, seq_index=0))]
    fn sequence_tokens(
        &self,
        py: Python<'_>,
        request_id: &str,
        seq_index: u32,
    ) -> PyResult<Vec<u32>> {
        self.with(py, |s| {
            s.sequence_tokens(request_id, seq_index)
                .map(<[u32]>::to_vec)
        })
        .py_err()
    }

    /// Cumulative figures and current occupancy as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |s| s.stats());
        let dict = PyDict::new(py);
        dict.set_item("steps", s.steps)?;
        dict.set_item("num_running", s.num_running)?;
        dict.set_item("num_waiting", s.num_waiting)?;
        dict.set_item("num_unfinished_requests", s.num_unfinished_requests)?;
        dict.set_item("scheduled_tokens", s.scheduled_tokens)?;
        dict.set_item("prefill_tokens", s.prefill_tokens)?;
        dict.set_item("generated_tokens", s.generated_tokens)?;
        dict.set_item("preemptions", s.preemptions)?;
        dict.set_item("finished_requests", s.finished_requests)?;
        dict.set_item("aborted_requests", s.aborted_requests)?;
        dict.set_item("peak_running", s.peak_running)?;
        dict.set_item("prefix_queried_tokens", s.prefix_queried_tokens)?;
        dict.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        dict.set_item("prefix_hit_rate", s.prefix_hit_rate)?;
        dict.set_item("kv_usage", s.kv_usage)?;
        dict.set_item("cow_copies", s.cow_copies)?;
        Ok(dict)
    }

    /// Raises AssertionError naming the first broken invariant of the scheduler or block manager.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| s.check_invariants())
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Running sequences.
    #[getter]
    fn num_running(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.num_running())
    }

    /// Waiting sequences (new or preempted).
    #[getter]
    fn num_waiting(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.num_waiting())
    }

    /// Requests waiting or running.
    #[getter]
    fn num_unfinished_requests(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.num_unfinished_requests())
    }

    /// Blocks an allocation could obtain now (clean plus evictable cached).
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.block_manager().num_available_blocks())
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.config().block_size)
    }

    #[getter]
    fn max_model_len(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.config().max_model_len)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.num_unfinished_requests(py)
    }

    fn __contains__(&self, py: Python<'_>, request_id: &str) -> bool {
        self.with(py, |s| s.contains(request_id))
    }
}

/// One step's batch, as numpy arrays a model runner uses directly (S rows, T tokens, K samples):
/// input_ids/positions/slot_mapping int64 [T]; query_start_loc int32 [S+1]; context_lens int32 [S]
/// (cached tokens including this step's); block_tables int32 [S, W] padded with -1; copy_ops
/// int64 [C, 2] (src, dst) to apply before attention; logits_indices int64 [K] (token row whose
/// logits give sample k); seq_indices/sample_seq_indices uint32 (sample index 0..n); request_ids/sample_request_ids
/// lists of str.
#[pyclass(name = "SchedulerOutput", module = "pagedkv", frozen)]
pub struct PySchedulerOutput {
    #[pyo3(get)]
    step: u64,
    num_seqs: usize,
    num_samples: usize,
    block_table_width: usize,
    stats: crate::scheduler::StepStats,
    /// The step's buffers; each moves into its numpy array the first time it is read, so a
    /// caller pays only for the arrays it uses (and never for a copy).
    data: Mutex<StepOutput>,
    arrays: [PyOnceLock<Py<PyAny>>; 10],
}

impl PySchedulerOutput {
    fn new(out: StepOutput) -> Self {
        PySchedulerOutput {
            step: out.step,
            num_seqs: out.num_seqs(),
            num_samples: out.num_samples(),
            block_table_width: out.block_table_width,
            stats: out.stats,
            data: Mutex::new(out),
            arrays: std::array::from_fn(|_| PyOnceLock::new()),
        }
    }

    fn data(&self) -> std::sync::MutexGuard<'_, StepOutput> {
        self.data
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The array in slot `slot`, made on first use from the buffer `take` moves out.
    fn array<'py>(
        &self,
        py: Python<'py>,
        slot: usize,
        take: impl FnOnce(Python<'py>, &mut StepOutput) -> PyResult<Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(array) = self.arrays[slot].get(py) {
            return Ok(array.clone_ref(py));
        }
        let array = take(py, &mut self.data())?.unbind();
        Ok(self.arrays[slot].get_or_init(py, || array).clone_ref(py))
    }
}

fn vector<'py, T: numpy::Element>(
    py: Python<'py>,
    data: &mut Vec<T>,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyArray1::from_vec(py, std::mem::take(data)).into_any())
}

/// A flat buffer of `(src, dst)` pairs as a `[C, 2]` array.
fn pairs<'py>(py: Python<'py>, data: &mut Vec<i64>) -> PyResult<Bound<'py, PyAny>> {
    let data = std::mem::take(data);
    let array =
        Array2::from_shape_vec((data.len() / 2, 2), data).map_err(|e| invalid(e.to_string()))?;
    Ok(array.into_pyarray(py).into_any())
}

#[pymethods]
impl PySchedulerOutput {
    /// Token ids to run, int64 [T].
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 0, |py, d| vector(py, &mut d.input_ids))
    }

    /// Position of each token in its sequence, int64 [T].
    #[getter]
    fn positions(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 1, |py, d| vector(py, &mut d.positions))
    }

    /// Cache slot (block * block_size + offset) to write each token's K/V to, int64 [T].
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 2, |py, d| vector(py, &mut d.slot_mapping))
    }

    /// Row i's tokens are query_start_loc[i]..query_start_loc[i+1], int32 [S+1].
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 3, |py, d| vector(py, &mut d.query_start_loc))
    }

    /// Tokens in the cache per row, including this step's, int32 [S].
    #[getter]
    fn context_lens(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 4, |py, d| vector(py, &mut d.context_lens))
    }

    /// Block table of each row, int32 [S, W], padded with -1.
    #[getter]
    fn block_tables(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let width = self.block_table_width;
        let rows = self.num_seqs;
        self.array(py, 5, |py, d| {
            let data = std::mem::take(&mut d.block_tables);
            let array =
                Array2::from_shape_vec((rows, width), data).map_err(|e| invalid(e.to_string()))?;
            Ok(array.into_pyarray(py).into_any())
        })
    }

    /// Copy-on-write block copies (src, dst) to apply before attention, int64 [C, 2].
    #[getter]
    fn copy_ops(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 6, |py, d| pairs(py, &mut d.copy_ops))
    }

    /// Token row whose logits give each sample, int64 [K].
    #[getter]
    fn logits_indices(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 7, |py, d| vector(py, &mut d.logits_indices))
    }

    /// Sample index (0..n) of each row's sequence, uint32 [S].
    #[getter]
    fn seq_indices(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 8, |py, d| vector(py, &mut d.seq_indices))
    }

    /// Sample index (0..n) of each sample's sequence, uint32 [K].
    #[getter]
    fn sample_seq_indices(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 9, |py, d| vector(py, &mut d.sample_seq_indices))
    }

    /// Request id of each row (scheduled sequence).
    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        strings(py, &self.data().request_ids)
    }

    /// Request id of each sample (parallel samples repeat their request).
    #[getter]
    fn sample_request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        strings(py, &self.data().sample_request_ids)
    }

    /// Rows (sequences) in the batch.
    #[getter]
    fn num_seqs(&self) -> usize {
        self.num_seqs
    }

    /// Tokens `update` expects.
    #[getter]
    fn num_samples(&self) -> usize {
        self.num_samples
    }

    /// Tokens scheduled (prefill + decode).
    #[getter]
    fn num_scheduled_tokens(&self) -> usize {
        self.stats.num_scheduled_tokens
    }

    /// This step's figures: num_running, num_waiting, num_preempted, num_admitted,
    /// num_scheduled_tokens, num_prefill_tokens, prefix_queried_tokens, prefix_hit_tokens, kv_usage.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.stats;
        let dict = PyDict::new(py);
        dict.set_item("num_running", s.num_running)?;
        dict.set_item("num_waiting", s.num_waiting)?;
        dict.set_item("num_preempted", s.num_preempted)?;
        dict.set_item("num_admitted", s.num_admitted)?;
        dict.set_item("num_scheduled_tokens", s.num_scheduled_tokens)?;
        dict.set_item("num_prefill_tokens", s.num_prefill_tokens)?;
        dict.set_item("prefix_queried_tokens", s.prefix_queried_tokens)?;
        dict.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        dict.set_item("kv_usage", s.kv_usage)?;
        Ok(dict)
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step={}, num_seqs={}, num_tokens={}, num_samples={})",
            self.step, self.num_seqs, self.stats.num_scheduled_tokens, self.num_samples
        )
    }
}

/// What one `update` produced: one entry per sample (except samples of aborted requests).
/// Iterating yields `(request_id, seq_index, token_id, finish_reason)` tuples, finish_reason
/// being None while the sequence continues, else "stop", "length" or "max_model_len".
#[pyclass(name = "UpdateOutput", module = "pagedkv", frozen, sequence)]
pub struct PyUpdateOutput {
    inner: UpdateOutput,
}

fn reason(finish: Option<FinishReason>) -> Option<&'static str> {
    finish.map(FinishReason::as_str)
}

#[pymethods]
impl PyUpdateOutput {
    /// Request id of each produced token.
    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.produced.iter().map(|p| &*p.request_id))
    }

    /// Sample index (0..n) of each produced token (uint32).
    #[getter]
    fn seq_indices<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_iter(py, self.inner.produced.iter().map(|p| p.seq_index))
    }

    /// The produced tokens (int64).
    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_iter(py, self.inner.produced.iter().map(|p| i64::from(p.token)))
    }

    /// Finish reason of each produced token's sequence, None if it continues.
    #[getter]
    fn finish_reasons<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.produced.iter().map(|p| reason(p.finish)))
    }

    /// Requests whose every sequence finished in this update.
    #[getter]
    fn finished_request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        strings(py, &self.inner.finished_requests)
    }

    fn __len__(&self) -> usize {
        self.inner.produced.len()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: isize) -> PyResult<Bound<'py, PyTuple>> {
        let len = self.inner.produced.len() as isize;
        let at = if index < 0 { index + len } else { index };
        if !(0..len).contains(&at) {
            return Err(pyo3::exceptions::PyIndexError::new_err(
                "UpdateOutput index out of range",
            ));
        }
        let p = &self.inner.produced[at as usize];
        (&*p.request_id, p.seq_index, p.token, reason(p.finish)).into_pyobject(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "UpdateOutput(produced={}, finished={:?})",
            self.inner.produced.len(),
            self.inner
                .finished_requests
                .iter()
                .map(|id| &**id)
                .collect::<Vec<_>>()
        )
    }
}
