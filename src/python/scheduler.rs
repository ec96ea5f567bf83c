//! `pagedkv.Scheduler` (the binding of the core's `KvRuntime`: the scheduler with the K/V bytes
//! its steps address and the disk tier), its step `SchedulerOutput` — the one way into those
//! K/V bytes — and the update result `UpdateOutput`.
//!
//! A step's arrays are moved out of the core into numpy arrays that own them (no copy); the core
//! `Step` keeps its own copy of those that address the K/V bytes, so what Python does to the
//! arrays changes nothing it touches. Request ids are turned into Python lists only when read.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::ndarray::Ix3;
use numpy::ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::args::{arg, c_order, expect_shape, invalid, opt, typed_array, Bytes, Param};
use super::attention_call::{query_array, scale_and_path};
use super::errors::IntoPyResult;
use super::events;
use super::kv_spec::{PyGroupSpec, PyKvSpec};
use super::sync::{detached, locked};
use super::tier;
use crate::ids::TokenId;
use crate::kv::coordinator::capacity_tokens;
use crate::kv::spec::KvCacheConfig;
use crate::memory::block_manager::DEFAULT_BLOCK_SIZE;
use crate::memory::eviction::EvictionPolicy;
use crate::runtime::{KvRuntime, Step};
use crate::scheduler::{
    default_offload_watermark, Figure, FinishReason, Policy, RequestEvent, RequestOptions,
    SamplingParams, Scheduler, SchedulerConfig, StepOutput, UpdateOutput, DEFAULT_AGING_STEPS,
};
use crate::store::dtype::KvDtype;
use crate::store::kv_cache::KvShape;

/// Continuous-batching scheduler over a paged KV cache, with the K/V bytes of its pool when made
/// with a `kv_spec`. Thread-safe; every call releases the GIL.
#[pyclass(name = "Scheduler", module = "pagedkv", frozen)]
pub struct PyScheduler {
    inner: Arc<KvRuntime>,
    /// The shape of its K/V store, if it has one (fixed at construction).
    kv_shape: Option<KvShape>,
}

impl PyScheduler {
    /// Runs a read-only `query` on the scheduler (GIL released).
    fn read<T: Send>(
        &self,
        py: Python<'_>,
        query: impl FnOnce(&Scheduler) -> T + Send,
    ) -> PyResult<T> {
        detached(py, || self.inner.read(query))
    }

    /// Runs `f` on the runtime (GIL released).
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&KvRuntime) -> crate::error::Result<T> + Send,
    ) -> PyResult<T> {
        detached(py, || f(&self.inner))
    }
}

/// Stats figures as a dict, by their names.
fn figures<'py>(py: Python<'py>, figures: &[(&str, Figure)]) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for &(name, figure) in figures {
        match figure {
            Figure::Count(n) => dict.set_item(name, n)?,
            Figure::Fraction(x) => dict.set_item(name, x)?,
        }
    }
    Ok(dict)
}

fn strings<'py>(py: Python<'py>, ids: &[Arc<str>]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ids.iter().map(|id| &**id))
}

#[pymethods]
impl PyScheduler {
    /// Every limit left out keeps the default of `SchedulerConfig::new` (`SCHEDULER_DEFAULTS`).
    #[new]
    #[pyo3(
        signature = (
            num_blocks, block_size=Param::Absent, max_num_seqs=Param::Absent,
            max_num_batched_tokens=Param::Absent, max_model_len=None,
            enable_prefix_caching=Param::Absent, policy=Param::Absent, aging_steps=Param::Absent,
            long_prefill_token_threshold=Param::Absent, eos_token_ids=None,
            admission_lookahead_tokens=Param::Absent, eviction_policy=Param::Absent,
            emit_kv_events=Param::Absent, min_load_blocks=Param::Absent,
            offload_watermark_blocks=None, kv_spec=None,
        ),
        text_signature = "(num_blocks, block_size=..., max_num_seqs=..., \
            max_num_batched_tokens=..., max_model_len=None, enable_prefix_caching=..., \
            policy=..., aging_steps=..., long_prefill_token_threshold=..., eos_token_ids=None, \
            admission_lookahead_tokens=..., eviction_policy=..., emit_kv_events=..., \
            min_load_blocks=..., offload_watermark_blocks=None, kv_spec=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: Param<'_>,
        max_num_seqs: Param<'_>,
        max_num_batched_tokens: Param<'_>,
        max_model_len: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: Param<'_>,
        policy: Param<'_>,
        aging_steps: Param<'_>,
        long_prefill_token_threshold: Param<'_>,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        admission_lookahead_tokens: Param<'_>,
        eviction_policy: Param<'_>,
        emit_kv_events: Param<'_>,
        min_load_blocks: Param<'_>,
        offload_watermark_blocks: Option<&Bound<'_, PyAny>>,
        kv_spec: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut c = SchedulerConfig::new(
            arg(num_blocks, "num_blocks")?,
            block_size.or("block_size", DEFAULT_BLOCK_SIZE)?,
        );
        c.max_num_seqs = max_num_seqs.or("max_num_seqs", c.max_num_seqs)?;
        c.max_num_batched_tokens =
            max_num_batched_tokens.or("max_num_batched_tokens", c.max_num_batched_tokens)?;
        let max_model_len = opt(max_model_len, "max_model_len")?;
        if let Some(len) = max_model_len {
            c.max_model_len = len;
        }
        c.enable_prefix_caching =
            enable_prefix_caching.or("enable_prefix_caching", c.enable_prefix_caching)?;
        let policy: String = policy.or("policy", c.policy.name().into())?;
        let eviction_policy: String =
            eviction_policy.or("eviction_policy", c.eviction_policy.name().into())?;
        let aging_steps = aging_steps.or("aging_steps", DEFAULT_AGING_STEPS)?;
        c.long_prefill_token_threshold = long_prefill_token_threshold.or(
            "long_prefill_token_threshold",
            c.long_prefill_token_threshold,
        )?;
        c.eos_token_ids = opt(eos_token_ids, "eos_token_ids")?.unwrap_or_default();
        c.admission_lookahead_tokens = admission_lookahead_tokens
            .or("admission_lookahead_tokens", c.admission_lookahead_tokens)?;
        c.emit_kv_events = emit_kv_events.or("emit_kv_events", c.emit_kv_events)?;
        c.min_load_blocks = min_load_blocks.or("min_load_blocks", c.min_load_blocks)?;
        let watermark = opt(offload_watermark_blocks, "offload_watermark_blocks")?;
        let kv_spec = match kv_spec {
            None => None,
            Some(spec) => Some(
                spec.cast::<PyKvSpec>()
                    .map_err(|_| invalid("kv_spec must be a KvSpec".into()))?
                    .get()
                    .inner
                    .clone(),
            ),
        };
        if let (None, Some(spec)) = (max_model_len, &kv_spec) {
            // The default: the longest sequence the cache holds in every group (a spec the
            // runtime refuses keeps the whole cache, and the runtime says why).
            if let Ok(layout) = KvCacheConfig::derive(spec, c.block_size) {
                c.max_model_len = c.max_model_len.min(capacity_tokens(
                    &layout.kept(),
                    c.num_blocks,
                    c.max_num_batched_tokens,
                ));
            }
        }
        let runtime = detached(py, || {
            c.policy = Policy::from_name(&policy, aging_steps)?;
            c.eviction_policy = EvictionPolicy::from_name(&eviction_policy)?;
            // Left out: the default for the limits as given (the core's).
            c.offload_watermark_blocks = watermark.unwrap_or_else(|| {
                default_offload_watermark(c.num_blocks, c.block_size, c.max_num_batched_tokens)
            });
            KvRuntime::new(c, kv_spec)
        })?;
        let kv_shape = runtime.kv_layout().py_err()?.map(|(shape, _)| shape);
        Ok(PyScheduler {
            inner: Arc::new(runtime),
            kv_shape,
        })
    }

    /// The model's K/V spec it was made with, or None.
    #[getter]
    fn kv_spec(&self) -> Option<PyKvSpec> {
        let (spec, _) = self.inner.kv_spec()?;
        Some(PyKvSpec {
            inner: spec.clone(),
        })
    }

    /// The KV cache groups derived from its K/V spec (empty without one).
    #[getter]
    fn kv_groups(&self) -> Vec<PyGroupSpec> {
        let groups = self
            .inner
            .kv_spec()
            .map(|(_, layout)| layout.groups.as_slice());
        let groups = groups.unwrap_or_default().iter().cloned();
        groups.map(|inner| PyGroupSpec { inner }).collect()
    }

    /// Opens (or creates) the disk tier in directory `path` for the scheduler's K/V (it needs a
    /// `kv_spec`), at most `capacity_bytes` of K/V data, recording `identity` (the model's: a tier
    /// recorded under another is cleared), and attaches it: evicted cached blocks are offloaded to
    /// it, prefix hits on it loaded back. Returns what opening found: `{"recovered": blocks,
    /// "cleared": bool}`. Raises, attaching nothing, InvalidArgumentError for a bad argument, a
    /// scheduler without K/V, a tier attached already, or a scheduler that has served a request;
    /// KvTierError if the directory or its files cannot be made, opened or locked (another
    /// engine holds them).
    #[pyo3(signature = (path, capacity_bytes, identity))]
    fn attach_disk_tier<'py>(
        &self,
        py: Python<'py>,
        path: &Bound<'py, PyAny>,
        capacity_bytes: &Bound<'py, PyAny>,
        identity: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let path: PathBuf = arg(path, "path")?;
        let capacity: u64 = arg(capacity_bytes, "capacity_bytes")?;
        let Bytes(identity) = arg(identity, "identity")?;
        let opened = self.run(py, |r| r.open_disk_tier(&path, capacity, identity))?;
        tier::opened(py, &opened)
    }

    /// Finishes the disk tier's queued writes and loads, then closes it (its files released, so
    /// another scheduler may open the directory); cached RAM blocks stay. Returns the tier's last
    /// KV events (with `emit_kv_events`: those not yet taken, then `("cleared", "disk")`), to
    /// publish after `take_kv_events()`. Without a tier, nothing (an empty list).
    fn detach_disk_tier<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let last = self.run(py, KvRuntime::close_disk_tier)?;
        events::events(py, &last)
    }

    /// Blocks until the disk tier has finished every queued write and load (the next
    /// `schedule()` sees the loads). Without a tier, nothing.
    fn flush_disk_tier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, KvRuntime::flush_disk_tier)
    }

    /// The KV events since the last call, in order (empty unless made with `emit_kv_events`):
    /// `BlockStored`, `BlockRemoved` (each naming its KV cache group) or `AllBlocksCleared`,
    /// medium "ram" or "disk". Replaying every event taken since the scheduler was made gives
    /// `kv_blocks()`; replaying those of one group, `kv_blocks(group)`.
    fn take_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let taken = self.run(py, KvRuntime::take_kv_events)?;
        events::events(py, &taken)
    }

    /// The blocks findable now by prefix lookup, as `(block_hash, medium)` pairs (a block may be
    /// held in both media): of KV cache group `group`, or of every group (None). Raises
    /// InvalidArgumentError for a group the layout does not have.
    #[pyo3(signature = (group=None))]
    fn kv_blocks<'py>(
        &self,
        py: Python<'py>,
        group: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let group: Option<u32> = opt(group, "group")?;
        let groups = self.read(py, |s| s.kv_coordinator().num_groups())?;
        if let Some(g) = group.filter(|&g| g as usize >= groups) {
            return Err(invalid(format!(
                "group {g} outside the layout's 0..{groups}"
            )));
        }
        let held = self.run(py, KvRuntime::kv_blocks)?;
        tier::blocks(py, &held, group)
    }

    /// Queues a request. Raises DuplicateSequenceError for a live id, InvalidArgumentError for an
    /// empty prompt, a prompt leaving no room within max_model_len, or bad limits; nothing changes then.
    #[pyo3(
        signature = (
            request_id, prompt_token_ids, max_tokens=Param::Absent, stop_token_ids=None,
            ignore_eos=Param::Absent, priority=Param::Absent, arrival_time=None, cache_salt=None,
            n=Param::Absent,
        ),
        text_signature = "($self, request_id, prompt_token_ids, max_tokens=16, \
            stop_token_ids=None, ignore_eos=False, priority=0, arrival_time=None, cache_salt=None, \
            n=1)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: Param<'_>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: Param<'_>,
        priority: Param<'_>,
        arrival_time: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        n: Param<'_>,
    ) -> PyResult<()> {
        let defaults = SamplingParams::default();
        let request_id: String = arg(request_id, "request_id")?;
        let prompt: Vec<TokenId> = arg(prompt_token_ids, "prompt_token_ids")?;
        let params = SamplingParams {
            max_tokens: max_tokens.or("max_tokens", defaults.max_tokens)?,
            stop_token_ids: opt(stop_token_ids, "stop_token_ids")?.unwrap_or_default(),
            ignore_eos: ignore_eos.or("ignore_eos", defaults.ignore_eos)?,
            n: n.or("n", defaults.n)?,
        };
        let arrival_time = opt(arrival_time, "arrival_time")?.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        });
        let options = RequestOptions {
            priority: priority.or("priority", 0)?,
            arrival_time,
            cache_salt: opt::<String>(cache_salt, "cache_salt")?.map(String::into_bytes),
        };
        self.run(py, |r| r.add_request(&request_id, prompt, params, options))
    }

    /// Drops a request in any state and frees its blocks. Raises UnknownSequenceError if it is
    /// not waiting or running.
    fn abort(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_id: String = arg(request_id, "request_id")?;
        self.run(py, |r| r.abort(&request_id))
    }

    /// Ends one sample of a live request before its siblings, freeing its blocks (a step awaiting
    /// update skips it). Raises UnknownSequenceError for no such live sample, and
    /// InvalidArgumentError for the request's only live sample (abort the request instead).
    fn finish_sample(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        seq_index: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let request_id: String = arg(request_id, "request_id")?;
        let seq_index = arg(seq_index, "seq_index")?;
        self.run(py, |r| r.finish_sample(&request_id, seq_index))
    }

    /// Builds the next step (see SchedulerOutput). The previous step must have been updated.
    fn schedule(slf: &Bound<'_, Self>) -> PyResult<PySchedulerOutput> {
        let (output, step) = slf.get().run(slf.py(), KvRuntime::begin_step)?;
        Ok(PySchedulerOutput::new(output, step, slf.clone().unbind()))
    }

    /// Appends `sampled_token_ids[k]` (one per sample, i.e. per `output.logits_indices[k]`) and
    /// finishes sequences; returns what was produced. Raises ShapeError for a wrong length and
    /// InvalidArgumentError for an output that is not the step awaiting update (the core checks).
    fn update(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<PyUpdateOutput> {
        let output = output.cast::<PySchedulerOutput>().map_err(|_| {
            invalid(format!(
                "output must be the SchedulerOutput of schedule(), got {}",
                output
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let step = &output.get().step;
        let sampled: Vec<TokenId> = arg(sampled_token_ids, "sampled_token_ids")?;
        let inner = self.run(py, |r| r.finish_step(step, &sampled))?;
        Ok(PyUpdateOutput { inner })
    }

    /// Whether any request is waiting or running.
    fn has_unfinished(&self, py: Python<'_>) -> PyResult<bool> {
        self.read(py, Scheduler::has_unfinished)
    }

    /// Prompt plus output so far of sample `seq_index` of a live request.
    #[pyo3(
        signature = (request_id, seq_index=Param::Absent),
        text_signature = "($self, request_id, seq_index=0)"
    )]
    fn sequence_tokens(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        seq_index: Param<'_>,
    ) -> PyResult<Vec<u32>> {
        let request_id: String = arg(request_id, "request_id")?;
        let seq_index = seq_index.or("seq_index", 0)?;
        self.read(py, |s| {
            s.sequence_tokens(&request_id, seq_index)
                .map(<[u32]>::to_vec)
        })?
        .py_err()
    }

    /// Cumulative figures and current occupancy as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, tier) = self.run(py, |r| Ok((r.read(Scheduler::stats)?, r.tier_counters()?)))?;
        figures(py, &s.figures(tier.as_ref()))
    }

    /// Raises AssertionError naming the first broken invariant of the scheduler or block manager.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.read(py, |s| s.check_invariants())?
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Running sequences.
    #[getter]
    fn num_running(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.num_running())
    }

    /// Sequences waiting for their blocks to load from the disk tier.
    #[getter]
    fn num_loading(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.num_loading())
    }

    /// Waiting sequences (new or preempted).
    #[getter]
    fn num_waiting(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.num_waiting())
    }

    /// Requests waiting or running.
    #[getter]
    fn num_unfinished_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.num_unfinished_requests())
    }

    /// Blocks an allocation could obtain now (clean plus evictable cached).
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.block_manager().num_available_blocks())
    }

    /// Blocks each KV cache group's tables hold now, in `kv_groups` order (one entry, every
    /// block in use, without a KV spec).
    #[getter]
    fn kv_group_blocks(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        self.read(py, |s| s.kv_coordinator().blocks_in_use())
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.config().block_size)
    }

    #[getter]
    fn max_model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.read(py, |s| s.config().max_model_len)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.num_unfinished_requests(py)
    }

    /// Membership never raises for the key: anything that is not a valid request id (a non-str,
    /// a str with lone surrogates) is simply not in the scheduler.
    fn __contains__(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        match arg::<String>(request_id, "request_id") {
            Ok(id) => self.read(py, |s| s.contains(&id)),
            Err(_) => Ok(false),
        }
    }
}

/// One step's batch, as numpy arrays a model runner uses directly (S rows, T tokens, K samples):
/// input_ids/positions/slot_mapping int64 [T]; query_start_loc int32 [S+1]; context_lens int32 [S]
/// (cached tokens including this step's); block_tables int32 [S, W] padded with -1 (with G > 1
/// KV cache groups, slot_mapping [G, T] and block_tables [G, S, W], one per group); copy_ops
/// int64 [C, 2] (src, dst) to apply before attention; logits_indices int64 [K] (token row whose
/// logits give sample k); seq_indices/sample_seq_indices uint32 (sample index 0..n); request_ids/sample_request_ids
/// lists of str.
#[pyclass(name = "SchedulerOutput", module = "pagedkv", frozen)]
pub struct PySchedulerOutput {
    /// The core's step: its own copy of the arrays that address the K/V bytes.
    step: Step,
    /// The scheduler that made it, whose K/V the step's calls touch.
    scheduler: Py<PyScheduler>,
    num_seqs: usize,
    num_samples: usize,
    block_table_width: usize,
    num_kv_groups: usize,
    stats: crate::scheduler::StepStats,
    events: Vec<RequestEvent>,
    /// The step's buffers; each moves into its numpy array the first time it is read, so a
    /// caller pays only for the arrays it uses (and never for a copy).
    data: Mutex<StepOutput>,
    arrays: [PyOnceLock<Py<PyAny>>; 10],
}

type F32Array<'py, D> = numpy::PyReadonlyArray<'py, f32, D>;

impl PySchedulerOutput {
    fn new(mut out: StepOutput, step: Step, scheduler: Py<PyScheduler>) -> Self {
        PySchedulerOutput {
            events: std::mem::take(&mut out.events),
            step,
            scheduler,
            num_seqs: out.num_seqs(),
            num_samples: out.num_samples(),
            block_table_width: out.block_table_width,
            num_kv_groups: out.num_kv_groups.max(1),
            stats: out.stats,
            data: Mutex::new(out),
            arrays: std::array::from_fn(|_| PyOnceLock::new()),
        }
    }

    /// The array in slot `slot`, made once: `take` moves its buffer out of the step (under the
    /// lock), `make` turns it into the array (with the GIL).
    fn array<'py, B: Send>(
        &self,
        py: Python<'py>,
        slot: usize,
        take: impl FnOnce(&mut StepOutput) -> B + Send,
        make: impl FnOnce(Python<'py>, B) -> PyResult<Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let array = self.arrays[slot].get_or_try_init(py, || {
            let buffer = locked(py, &self.data, |d| Ok(take(d)))?;
            make(py, buffer).map(Bound::unbind)
        })?;
        Ok(array.clone_ref(py))
    }

    /// A copy of a list of request ids.
    fn ids(
        &self,
        py: Python<'_>,
        which: fn(&StepOutput) -> &Vec<Arc<str>>,
    ) -> PyResult<Vec<Arc<str>>> {
        locked(py, &self.data, |d| Ok(which(d).clone()))
    }

    /// The K/V shape of the scheduler that made the step; InvalidArgumentError without K/V.
    fn kv_shape(&self) -> PyResult<KvShape> {
        self.scheduler.get().kv_shape.ok_or_else(|| {
            invalid("this step's scheduler keeps no K/V (it was made without a kv_spec)".into())
        })
    }

    /// Runs `f` on the scheduler's runtime with this step (GIL released).
    pub(crate) fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&KvRuntime, &Step) -> crate::error::Result<T> + Send,
    ) -> PyResult<T> {
        let runtime = &self.scheduler.get().inner;
        detached(py, || f(runtime, &self.step))
    }
}

fn vector<T: numpy::Element>(py: Python<'_>, data: Vec<T>) -> PyResult<Bound<'_, PyAny>> {
    Ok(PyArray1::from_vec(py, data).into_any())
}

/// A flat buffer of `(src, dst)` pairs as a `[C, 2]` array.
fn pairs(py: Python<'_>, data: Vec<i64>) -> PyResult<Bound<'_, PyAny>> {
    let array =
        Array2::from_shape_vec((data.len() / 2, 2), data).map_err(|e| invalid(e.to_string()))?;
    Ok(array.into_pyarray(py).into_any())
}

#[pymethods]
impl PySchedulerOutput {
    /// Stores `keys[i]` and `values[i]` (float32 `[num_tokens, num_kv_heads, head_dim]`) of
    /// `layer` at this step's slots, converting to the K/V dtype. Only the scheduler's step
    /// awaiting update may touch its K/V: any other (updated, or of another scheduler) raises
    /// InvalidArgumentError, writing nothing, as does a value the dtype does not store as a
    /// finite number (NaN, infinity, beyond ±65504 in float16).
    fn write(
        &self,
        py: Python<'_>,
        layer: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let shape = self.kv_shape()?;
        let layer: usize = arg(layer, "layer")?;
        let keys: F32Array<'_, Ix3> = typed_array(keys, "keys", "float32")?;
        let values: F32Array<'_, Ix3> = typed_array(values, "values", "float32")?;
        let row = [
            Some(self.step.num_tokens()),
            Some(shape.num_kv_heads),
            Some(shape.head_dim),
        ];
        expect_shape(keys.shape(), &row, "keys")?;
        expect_shape(values.shape(), &row, "values")?;
        let (keys, values) = (c_order(&keys)?, c_order(&values)?);
        self.run(py, |r, step| r.write(step, layer, &keys, &values))
    }

    /// Applies this step's copy-on-write block copies (`copy_ops`), before its attention reads
    /// the K/V. Refused as `write` is for any step but the one awaiting update.
    fn copy_blocks(&self, py: Python<'_>) -> PyResult<()> {
        self.kv_shape()?;
        self.run(py, |r, step| r.copy_blocks(step))
    }

    /// Attention of `query` (float32 `[num_tokens, num_heads, head_dim]`) over `layer` through
    /// this step's block tables, context lengths and query offsets (see `KVCache.attention`),
    /// over the layer's sliding window when the scheduler's `kv_spec` gives it one (never the
    /// caller's: the spec is the one place it is stated); `scale` defaults to
    /// `1/sqrt(head_dim)`, `kernel` forces "avx2" or "portable". Refused as `write` is for any
    /// step but the one awaiting update. Returns a new float32 array shaped like `query`;
    /// releases the GIL while computing.
    #[pyo3(signature = (layer, query, scale=None, kernel=None))]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        query: &Bound<'py, PyAny>,
        scale: Option<&Bound<'py, PyAny>>,
        kernel: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let shape = self.kv_shape()?;
        let layer: usize = arg(layer, "layer")?;
        let query = query_array(query, shape.head_dim)?;
        let (scale, path) = scale_and_path(shape.head_dim, scale, kernel)?;
        let dims = <[usize; 3]>::try_from(query.shape()).map_err(|_| invalid("query".into()))?;
        let q = c_order(&query)?;
        let mut out = crate::alloc::try_zeroed_vec(q.len(), "the attention output").py_err()?;
        self.run(py, |r, step| {
            r.attention(step, path, layer, &q, dims[1], scale, &mut out)
        })?;
        Ok(PyArray1::from_vec(py, out).reshape(dims)?.into_any())
    }

    /// Token ids to run, int64 [T].
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 0, |d| std::mem::take(&mut d.input_ids), vector)
    }

    /// Position of each token in its sequence, int64 [T].
    #[getter]
    fn positions(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 1, |d| std::mem::take(&mut d.positions), vector)
    }

    /// Cache slot (block * block_size + offset) to write each token's K/V to, int64 [T]; with
    /// several KV cache groups, each group's, [G, T].
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let groups = self.num_kv_groups;
        self.array(
            py,
            2,
            |d| std::mem::take(&mut d.slot_mapping),
            move |py, data| match groups {
                1 => vector(py, data),
                _ => Ok(Array2::from_shape_vec((groups, data.len() / groups), data)
                    .map_err(|e| invalid(e.to_string()))?
                    .into_pyarray(py)
                    .into_any()),
            },
        )
    }

    /// KV cache groups (G) the slot mapping and block tables cover: each sequence has a block
    /// table per group (a hybrid model's full and sliding-window layers).
    #[getter]
    fn num_kv_groups(&self) -> usize {
        self.num_kv_groups
    }

    /// Row i's tokens are query_start_loc[i]..query_start_loc[i+1], int32 [S+1].
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 3, |d| std::mem::take(&mut d.query_start_loc), vector)
    }

    /// Tokens in the cache per row, including this step's, int32 [S].
    #[getter]
    fn context_lens(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 4, |d| std::mem::take(&mut d.context_lens), vector)
    }

    /// Block table of each row, int32 [S, W], padded with -1 (as are blocks a sliding window
    /// released); with several KV cache groups, each group's, [G, S, W].
    #[getter]
    fn block_tables(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let (groups, rows, width) = (self.num_kv_groups, self.num_seqs, self.block_table_width);
        self.array(
            py,
            5,
            |d| std::mem::take(&mut d.block_tables),
            move |py, data| match groups {
                1 => Ok(Array2::from_shape_vec((rows, width), data)
                    .map_err(|e| invalid(e.to_string()))?
                    .into_pyarray(py)
                    .into_any()),
                _ => Ok(Array3::from_shape_vec((groups, rows, width), data)
                    .map_err(|e| invalid(e.to_string()))?
                    .into_pyarray(py)
                    .into_any()),
            },
        )
    }

    /// Copy-on-write block copies (src, dst) to apply before attention, int64 [C, 2].
    #[getter]
    fn copy_ops(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 6, |d| std::mem::take(&mut d.copy_ops), pairs)
    }

    /// Token row whose logits give each sample, int64 [K].
    #[getter]
    fn logits_indices(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 7, |d| std::mem::take(&mut d.logits_indices), vector)
    }

    /// Sample index (0..n) of each row's sequence, uint32 [S].
    #[getter]
    fn seq_indices(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 8, |d| std::mem::take(&mut d.seq_indices), vector)
    }

    /// Sample index (0..n) of each sample's sequence, uint32 [K].
    #[getter]
    fn sample_seq_indices(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 9, |d| std::mem::take(&mut d.sample_seq_indices), vector)
    }

    /// Request id of each row (scheduled sequence).
    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        strings(py, &self.ids(py, |d| &d.request_ids)?)
    }

    /// Request id of each sample (parallel samples repeat their request).
    #[getter]
    fn sample_request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        strings(py, &self.ids(py, |d| &d.sample_request_ids)?)
    }

    /// Admissions and preemptions of this step, in order, as `(request_id, seq_index, kind,
    /// prefix_hit_tokens)` tuples: kind "admitted" (first admission), "resumed" (admitted again
    /// after a preemption) or "preempted" (hit 0); the hit is the prompt tokens found cached.
    #[getter]
    fn events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.events.iter().map(|e| {
                (
                    &*e.request_id,
                    e.seq_index,
                    e.kind.as_str(),
                    e.prefix_hit_tokens,
                )
            }),
        )
    }

    /// Step number (from 0) within the scheduler that built it.
    #[getter]
    fn step(&self) -> u64 {
        self.step.id().number()
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
        figures(py, &self.stats.figures())
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step={}, num_seqs={}, num_tokens={}, num_samples={})",
            self.step.id().number(),
            self.num_seqs,
            self.stats.num_scheduled_tokens,
            self.num_samples
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

/// The defaults of `Scheduler(...)`, read from `SchedulerConfig::new` (the one place they are
/// set) by every Python layer that has them: `EngineConfig`, the command line's flags.
/// `max_model_len` and `offload_watermark_blocks` depend on the limits given, so they are not in it.
pub fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = SchedulerConfig::new(1, DEFAULT_BLOCK_SIZE);
    let d = PyDict::new(py);
    d.set_item("block_size", c.block_size)?;
    d.set_item("max_num_seqs", c.max_num_seqs)?;
    d.set_item("max_num_batched_tokens", c.max_num_batched_tokens)?;
    d.set_item("enable_prefix_caching", c.enable_prefix_caching)?;
    d.set_item("policy", c.policy.name())?;
    d.set_item("aging_steps", DEFAULT_AGING_STEPS)?;
    d.set_item(
        "long_prefill_token_threshold",
        c.long_prefill_token_threshold,
    )?;
    d.set_item("admission_lookahead_tokens", c.admission_lookahead_tokens)?;
    d.set_item("eviction_policy", c.eviction_policy.name())?;
    d.set_item("emit_kv_events", c.emit_kv_events)?;
    d.set_item("min_load_blocks", c.min_load_blocks)?;
    d.set_item("kv_dtype", KvDtype::default().name())?;
    Ok(d)
}
