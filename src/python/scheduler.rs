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

use std::path::PathBuf;

use super::args::{arg, invalid, opt, Bytes, Param};
use super::kv_cache::PyKVCache;
use super::step_gate::StepGate;
use super::sync::{detached, locked};
use super::tier;
use crate::ids::TokenId;
use crate::memory::block_manager::DEFAULT_BLOCK_SIZE;
use crate::memory::events::{KvEvent, Medium};
use crate::memory::eviction::EvictionPolicy;
use crate::scheduler::{
    default_offload_watermark, FinishReason, Policy, RequestEvent, RequestOptions, SamplingParams,
    Scheduler, SchedulerConfig, StepId, StepOutput, UpdateOutput, DEFAULT_AGING_STEPS,
};
use crate::tier::TierCounters;

/// Continuous-batching scheduler over a paged KV cache. Thread-safe; every call releases the GIL.
#[pyclass(name = "Scheduler", module = "pagedkv", frozen)]
pub struct PyScheduler {
    inner: Mutex<Scheduler>,
    /// The disk tier's counters when it was detached (its figures stay in `stats()`).
    detached_tier: Mutex<Option<TierCounters>>,
    /// The step awaiting update, for the cache a disk tier shares (`step_gate`).
    gate: Arc<StepGate>,
    /// That cache, from attach to detach (ungated at detach).
    gated_cache: Mutex<Option<Py<PyKVCache>>>,
}

impl PyScheduler {
    /// Whether `cache` is the one gated behind this scheduler's attached tier.
    fn is_gated_cache(&self, cache: &Bound<'_, PyKVCache>) -> bool {
        let gated = self.gated_cache.lock().unwrap_or_else(|e| e.into_inner());
        gated.as_ref().is_some_and(|held| held.is(cache))
    }

    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> crate::Result<T> + Send,
    ) -> PyResult<T> {
        locked(py, &self.inner, f)
    }
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
            offload_watermark_blocks=None,
        ),
        text_signature = "(num_blocks, block_size=..., max_num_seqs=..., \
            max_num_batched_tokens=..., max_model_len=None, enable_prefix_caching=..., \
            policy=..., aging_steps=..., long_prefill_token_threshold=..., eos_token_ids=None, \
            admission_lookahead_tokens=..., eviction_policy=..., emit_kv_events=..., \
            min_load_blocks=..., offload_watermark_blocks=None)"
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
    ) -> PyResult<Self> {
        let mut c = SchedulerConfig::new(
            arg(num_blocks, "num_blocks")?,
            block_size.or("block_size", DEFAULT_BLOCK_SIZE)?,
        );
        c.max_num_seqs = max_num_seqs.or("max_num_seqs", c.max_num_seqs)?;
        c.max_num_batched_tokens =
            max_num_batched_tokens.or("max_num_batched_tokens", c.max_num_batched_tokens)?;
        if let Some(len) = opt(max_model_len, "max_model_len")? {
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
        let scheduler = detached(py, || {
            c.policy = Policy::from_name(&policy, aging_steps)?;
            c.eviction_policy = EvictionPolicy::from_name(&eviction_policy)?;
            // Left out: the default for the limits as given (the core's).
            c.offload_watermark_blocks = watermark.unwrap_or_else(|| {
                default_offload_watermark(c.num_blocks, c.block_size, c.max_num_batched_tokens)
            });
            Scheduler::new(c)
        })?;
        Ok(PyScheduler {
            inner: Mutex::new(scheduler),
            detached_tier: Mutex::new(None),
            gate: Arc::default(),
            gated_cache: Mutex::new(None),
        })
    }

    /// Opens (or creates) the disk tier in directory `path` for the blocks of `kv_cache` (the
    /// cache the scheduler's steps index), at most `capacity_bytes` of K/V data, recording
    /// `identity` (the model's: a tier recorded under another is cleared), and attaches it: evicted
    /// cached blocks are offloaded to it, prefix hits on it loaded back. Returns what opening
    /// found: `{"recovered": blocks, "cleared": bool}`. Raises, attaching nothing,
    /// InvalidArgumentError for a bad argument, a cache of another pool size or block size, a
    /// tier attached already, or a scheduler that has served a request; KvTierError if the
    /// directory or its files cannot be made, opened or locked (another engine holds them).
    #[pyo3(signature = (kv_cache, path, capacity_bytes, identity))]
    fn attach_disk_tier<'py>(
        &self,
        py: Python<'py>,
        kv_cache: &Bound<'py, PyAny>,
        path: &Bound<'py, PyAny>,
        capacity_bytes: &Bound<'py, PyAny>,
        identity: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let bound = kv_cache
            .cast::<PyKVCache>()
            .map_err(|_| invalid("kv_cache must be a KVCache".into()))?;
        let cache = bound.get();
        let path: PathBuf = arg(path, "path")?;
        let capacity: u64 = arg(capacity_bytes, "capacity_bytes")?;
        let Bytes(identity) = arg(identity, "identity")?;
        // Gated before the tier's thread can touch it, ungated again if the attach fails.
        cache.set_gate(Some(self.gate.clone()))?;
        let io = cache.block_io(py)?;
        let opened = self.with(py, move |s| {
            tier::attach_disk_tier(s, &path, io, capacity, identity)
        });
        let opened = match opened {
            Ok(opened) => opened,
            Err(error) => {
                if !self.is_gated_cache(bound) {
                    cache.set_gate(None)?;
                }
                return Err(error);
            }
        };
        let cache_ref = bound.clone().unbind();
        locked(py, &self.gated_cache, move |g| {
            *g = Some(cache_ref);
            Ok(())
        })?;
        tier::opened(py, &opened)
    }

    /// Finishes the disk tier's queued writes and loads, then closes it (its files released, so
    /// another scheduler may open the directory); cached RAM blocks stay. Returns the tier's last
    /// KV events (with `emit_kv_events`: those not yet taken, then `("cleared", "disk")`), to
    /// publish after `take_kv_events()`. Without a tier, nothing (an empty list).
    fn detach_disk_tier<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let (last, counters) = self.with(py, |s| {
            let mut last = Vec::new();
            let Some(mut tier) = s.detach_tier() else {
                return Ok((last, None));
            };
            if s.config().emit_kv_events {
                tier.drain_events(&mut last);
                last.push(KvEvent::AllBlocksCleared {
                    medium: Medium::Disk,
                });
            }
            let counters = tier.counters();
            drop(tier); // joins its I/O thread and closes its files, without the GIL
            Ok((last, Some(counters)))
        })?;
        if counters.is_some() {
            locked(py, &self.detached_tier, |d| {
                *d = counters;
                Ok(())
            })?;
            // The tier's thread has ended: the cache is the caller's again.
            let cache = locked(py, &self.gated_cache, |g| Ok(g.take()))?;
            if let Some(cache) = cache {
                cache.get().set_gate(None)?;
            }
        }
        tier::events(py, &last)
    }

    /// Blocks until the disk tier has finished every queued write and load (the next
    /// `schedule()` sees the loads). Without a tier, nothing.
    fn flush_disk_tier(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| {
            s.flush_tier();
            Ok(())
        })
    }

    /// The KV events since the last call, in order (empty unless made with `emit_kv_events`):
    /// `("stored", block_hash, parent_block_hash, token_ids, medium)`, `("removed", block_hash,
    /// medium)` or `("cleared", medium)`, medium "ram" or "disk". Replaying every event taken
    /// since the scheduler was made gives `kv_blocks()`.
    fn take_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let taken = self.with(py, |s| Ok(s.take_kv_events()))?;
        tier::events(py, &taken)
    }

    /// The blocks findable now by prefix lookup, as `(block_hash, medium)` pairs (a block may be
    /// held in both media).
    fn kv_blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let held = self.with(py, |s| Ok(s.kv_blocks()))?;
        tier::blocks(py, &held)
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
        self.with(py, |s| s.add_request(&request_id, prompt, params, options))
    }

    /// Drops a request in any state and frees its blocks. Raises UnknownSequenceError if it is
    /// not waiting or running.
    fn abort(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_id: String = arg(request_id, "request_id")?;
        self.with(py, |s| s.abort(&request_id))
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
        self.with(py, |s| s.finish_sample(&request_id, seq_index))
    }

    /// Builds the next step (see SchedulerOutput). The previous step must have been updated.
    fn schedule(&self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let gate = &self.gate;
        let out = self.with(py, |s| {
            s.schedule()?;
            let out = s.take_step_output();
            gate.set(Some(out.id));
            Ok(out)
        })?;
        Ok(PySchedulerOutput::new(out))
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
        let step = output
            .cast::<PySchedulerOutput>()
            .map_err(|_| {
                invalid(format!(
                    "output must be the SchedulerOutput of schedule(), got {}",
                    output
                        .get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })?
            .get()
            .id;
        let sampled: Vec<TokenId> = arg(sampled_token_ids, "sampled_token_ids")?;
        let gate = &self.gate;
        let inner = self.with(py, |s| {
            gate.close_after(|| s.update(step, &sampled))?;
            Ok(s.take_update_output())
        })?;
        Ok(PyUpdateOutput { inner })
    }

    /// Whether any request is waiting or running.
    fn has_unfinished(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |s| Ok(s.has_unfinished()))
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
        self.with(py, |s| {
            s.sequence_tokens(&request_id, seq_index)
                .map(<[u32]>::to_vec)
        })
    }

    /// Cumulative figures and current occupancy as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, attached) = self.with(py, |s| Ok((s.stats(), s.block_manager().has_tier())))?;
        let tier = match attached {
            true => Some(s.tier),
            false => locked(py, &self.detached_tier, |d| Ok(*d))?,
        };
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
        dict.set_item("num_loading", s.num_loading)?;
        if let Some(tier) = tier {
            tier::add_stats(&dict, &s, &tier)?;
        }
        Ok(dict)
    }

    /// Raises AssertionError naming the first broken invariant of the scheduler or block manager.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |s| Ok(s.check_invariants()))?
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Running sequences.
    #[getter]
    fn num_running(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.num_running()))
    }

    /// Sequences waiting for their blocks to load from the disk tier.
    #[getter]
    fn num_loading(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.num_loading()))
    }

    /// Waiting sequences (new or preempted).
    #[getter]
    fn num_waiting(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.num_waiting()))
    }

    /// Requests waiting or running.
    #[getter]
    fn num_unfinished_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.num_unfinished_requests()))
    }

    /// Blocks an allocation could obtain now (clean plus evictable cached).
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.block_manager().num_available_blocks()))
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.config().block_size))
    }

    #[getter]
    fn max_model_len(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| Ok(s.config().max_model_len))
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.num_unfinished_requests(py)
    }

    /// Membership never raises for the key: anything that is not a valid request id (a non-str,
    /// a str with lone surrogates) is simply not in the scheduler.
    fn __contains__(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        match arg::<String>(request_id, "request_id") {
            Ok(id) => self.with(py, |s| Ok(s.contains(&id))),
            Err(_) => Ok(false),
        }
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
    id: StepId,
    num_seqs: usize,
    num_samples: usize,
    block_table_width: usize,
    stats: crate::scheduler::StepStats,
    events: Vec<RequestEvent>,
    /// The step's buffers; each moves into its numpy array the first time it is read, so a
    /// caller pays only for the arrays it uses (and never for a copy).
    data: Mutex<StepOutput>,
    arrays: [PyOnceLock<Py<PyAny>>; 10],
}

impl PySchedulerOutput {
    /// Which step of which scheduler this is.
    pub(crate) fn id(&self) -> StepId {
        self.id
    }

    fn new(mut out: StepOutput) -> Self {
        PySchedulerOutput {
            events: std::mem::take(&mut out.events),
            id: out.id,
            num_seqs: out.num_seqs(),
            num_samples: out.num_samples(),
            block_table_width: out.block_table_width,
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

    /// Cache slot (block * block_size + offset) to write each token's K/V to, int64 [T].
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.array(py, 2, |d| std::mem::take(&mut d.slot_mapping), vector)
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

    /// Block table of each row, int32 [S, W], padded with -1.
    #[getter]
    fn block_tables(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let width = self.block_table_width;
        let rows = self.num_seqs;
        self.array(
            py,
            5,
            |d| std::mem::take(&mut d.block_tables),
            |py, data| {
                let array = Array2::from_shape_vec((rows, width), data)
                    .map_err(|e| invalid(e.to_string()))?;
                Ok(array.into_pyarray(py).into_any())
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
        self.id.number()
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
            self.id.number(),
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
    Ok(d)
}
