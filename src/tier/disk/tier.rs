//! The disk tier behind [`KvTier`]: a [`DiskStore`] driven by one I/O thread (`pagedkv-disk-io`),
//! fed by a channel, following the offload/load protocol of [`crate::tier`].
//!
//! Invariants:
//! - Offload: the thread copies the block out of RAM, pushes it on the pool's free list, counts it
//!   in `returned` (in that order), and only then stores the copy (`fdatasync`ed, entry
//!   committed). Every offload job's block goes back to the free list exactly once, whatever
//!   happens to the copy (an I/O error, a panic or a full queue lose the copy, counted in
//!   `offloads_lost`, never the block id).
//! - Copy-outs do not wait behind disk work: before each load or group of stores the thread takes
//!   every job already queued and copies out the offloads among them, so a block waits for at
//!   most one disk operation. Their copies wait in memory, at most [`MAX_QUEUED_BYTES`] of them.
//! - Loads go first: a load is on a request's critical path, a store is not. The thread serves
//!   every queued load before any store; stores are committed in groups (the queue's oldest
//!   copies, at most [`MAX_GROUP_BLOCKS`] and [`MAX_GROUP_BYTES`]: one `fdatasync`, one index
//!   commit, [`DiskStore::store_group`]), so a load arriving meanwhile waits for one group at most.
//! - A load of a hash whose store is still queued is served from the queued copy (checked against
//!   the job's parent and tokens: it never left memory), so a load queued after the offload of the
//!   same hash finds it, as if the store had run first. Moving a copy-out ahead of an earlier load
//!   is safe: the manager never offloads a block before its load has completed.
//! - Load: the entry is read and verified (checksum, tokens, parent and KV cache group) into a scratch
//!   buffer, and only a verified block is written into RAM. An entry that does not verify is
//!   dropped ([`LoadOutcome::Dropped`], counted in `dropped_corrupt`); every other end that serves
//!   nothing (not held, an I/O error, a panic, a bad block id) is `Dropped` too, counted in
//!   `load_misses`.
//! - `committed` is exactly the store's set of entries after the last finished job; the events
//!   (`Disk` medium) describe it: opening emits `AllBlocksCleared` if a tier was cleared (of another
//!   identity, or an unreadable index) and one `BlockStored` per recovered entry, each store a `BlockStored`, each eviction or
//!   dropped entry a `BlockRemoved`, all published with the change under one lock.
//! - `contains` is true for committed hashes and for hashes whose offload is queued.
//! - The shared state's mutex is never held across I/O, so the scheduler's calls never wait on
//!   the disk (only `flush` does, by design). Dropping the tier finishes every queued job, then
//!   joins the thread.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use rustc_hash::FxHashMap;

use super::{DiskStore, Fetch, NewBlock, Opened};
use crate::error::{ensure, Error, Result};
use crate::ids::BlockId;
use crate::memory::events::{KvEvent, Medium};
use crate::memory::eviction::EvictionPolicy;
use crate::memory::prefix_cache::{BlockHash, BlockKey};
use crate::store::kv_cache::KvBlockIo;
use crate::tier::{KvTier, LoadDone, LoadJob, LoadOutcome, OffloadJob, TierCounters, TierLink};

/// Most bytes of copied-out blocks waiting for their store (one block always fits). Past it an
/// offload returns its block without a copy (counted lost): a disk slower than the eviction rate
/// costs cache hits, not unbounded memory. 64 MiB is 182 blocks of SmolLM2-135M in float16.
pub const MAX_QUEUED_BYTES: usize = 64 << 20;

/// What a disk tier is opened with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTierConfig {
    /// The model's fingerprint (config and weights hash); the tier adds the KV layout and dtype.
    pub identity: Vec<u8>,
    /// Most bytes of block data on disk.
    pub capacity_bytes: u64,
    /// Eviction order of a full tier.
    pub policy: EvictionPolicy,
}

enum Job {
    Offload(OffloadJob),
    Load(LoadJob),
}

/// Most bytes of one group of stores. Measured on this machine's disk (a VM's virtio disk,
/// SmolLM2-135M float16 blocks of 360 KiB): `fdatasync` costs 2.6 ms for one block, 14 ms for 16,
/// 29 ms for 32, and a redb commit about 3 ms more, so 4 MiB (11 such blocks) keeps the wait of a
/// load behind a group short while sharing the fixed costs: `cargo bench --bench disk_tier`
/// (machine loaded) stores such a block into a full tier in 12.1 ms one by one, 2.1 ms in a group
/// of 11 (23 ms a group), and a load sent behind 32 queued offloads gets its `LoadDone` in 15 ms
/// (about 290 ms when the loads waited behind every store, one by one).
pub const MAX_GROUP_BYTES: usize = 4 << 20;

/// Most blocks of one group of stores (small blocks): past 32 the commits' fixed cost, shared,
/// is already a small part of each block's (the tiny model's 16 KiB blocks: 8.4 ms each one by
/// one, 0.37 ms in a group of 32, same bench).
pub const MAX_GROUP_BLOCKS: usize = 32;

/// A copied-out block waiting for its store.
struct Copy {
    job: OffloadJob,
    data: Vec<u8>,
}

/// What both threads see.
#[derive(Default)]
struct State {
    /// Each committed hash's KV cache group.
    committed: FxHashMap<BlockHash, u32>,
    /// Hashes of queued offloads, with their number.
    pending: FxHashMap<BlockHash, usize>,
    events: Vec<KvEvent>,
    done: Vec<LoadDone>,
    counters: TierCounters,
    /// Jobs queued and not yet finished.
    outstanding: usize,
}

struct Shared {
    state: Mutex<State>,
    idle: Condvar,
}

impl Shared {
    /// The state. No code panics while holding it, so a poisoned lock still guards whole state.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The disk tier: see the module doc.
pub struct DiskTier {
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    link: TierLink,
}

impl DiskTier {
    /// Opens (or creates) the tier in `dir` for the blocks of `kv`, returning blocks to `link`,
    /// and starts its I/O thread. A tier written for another identity, KV layout or dtype, or
    /// whose index is unreadable, is cleared. Fails with `InvalidArgument` if `link`'s free list is
    /// not the size of `kv`'s pool, or as [`DiskStore::open`] does (an empty path, a capacity
    /// holding no block or larger than the file system; `OutOfMemory`; `Io` if the directory or
    /// files are refused or cannot be opened).
    ///
    /// # Safety
    /// The caller drives the tier by the protocol of [`crate::tier`] and keeps the engine to it: no
    /// thread writes a block while its offload is queued, and no thread accesses the block of a
    /// load until its [`LoadDone`] has been taken from [`KvTier::completed_loads`]. The I/O thread
    /// reads and writes those blocks of `kv` concurrently with the engine (see
    /// [`crate::store::kv_cache`]).
    pub unsafe fn open(
        dir: &Path,
        config: DiskTierConfig,
        kv: KvBlockIo,
        link: TierLink,
    ) -> Result<(DiskTier, Opened)> {
        let shape = kv.shape();
        ensure(link.free.capacity() == shape.num_blocks, || {
            format!(
                "the free list holds {} blocks, the KV cache {}",
                link.free.capacity(),
                shape.num_blocks
            )
        })?;
        let mut identity = config.identity;
        identity.extend_from_slice(
            format!(
                "|kv {} layers {} kv_heads {} block {} head_dim {} {}-endian",
                kv.dtype().name(),
                shape.num_layers,
                shape.num_kv_heads,
                shape.block_size,
                shape.head_dim,
                if cfg!(target_endian = "little") {
                    "little"
                } else {
                    "big"
                },
            )
            .as_bytes(),
        );
        let (store, opened) = DiskStore::open(
            dir,
            &identity,
            kv.slot_bytes(),
            config.capacity_bytes,
            config.policy,
        )?;
        let mut state = State::default();
        if opened.cleared {
            state.events.push(KvEvent::AllBlocksCleared {
                medium: Medium::Disk,
            });
        }
        let mut records: Vec<_> = store.records().collect();
        records.sort_unstable_by_key(|&(hash, _)| hash);
        for (hash, record) in records {
            state.committed.insert(hash, record.group);
            let key = BlockKey {
                hash,
                parent: record.parent,
                tokens: record.tokens.clone(),
            };
            state.events.push(KvEvent::BlockStored {
                key,
                medium: Medium::Disk,
                group: record.group,
            });
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            idle: Condvar::new(),
        });
        let (jobs, receiver) = mpsc::channel();
        let mut worker = Worker {
            scratch: vec![0; kv.slot_bytes()],
            store,
            kv,
            link: link.clone(),
            shared: Arc::clone(&shared),
            jobs: receiver,
            loads_queued: VecDeque::new(),
            copies: VecDeque::new(),
            queued_bytes: 0,
            loads: 0,
            misses: 0,
            lost: 0,
        };
        worker.publish(&mut shared.lock());
        let worker = std::thread::Builder::new()
            .name("pagedkv-disk-io".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::Io(format!("cannot start the disk tier's I/O thread: {e}")))?;
        let tier = DiskTier {
            jobs: Some(jobs),
            worker: Some(worker),
            shared,
            link,
        };
        Ok((tier, opened))
    }

    /// Queues `job`, or, if the I/O thread is gone (it never exits while the tier lives; this is
    /// the guard that keeps the protocol if it did), ends it here as a failed job.
    fn submit(&mut self, job: Job) {
        let Some(mpsc::SendError(job)) = self.jobs.as_ref().and_then(|j| j.send(job).err()) else {
            return;
        };
        let mut state = self.shared.lock();
        match job {
            Job::Offload(job) => {
                return_block(&self.link, job.block);
                unpend(&mut state, job.key.hash);
                state.counters.offloads_lost += 1;
            }
            Job::Load(job) => {
                state.done.push(LoadDone {
                    block: job.block,
                    outcome: LoadOutcome::Dropped,
                });
                state.counters.load_misses += 1;
            }
        }
        finish(&mut state, &self.shared.idle, 1);
    }
}

impl KvTier for DiskTier {
    fn contains(&self, hash: BlockHash) -> bool {
        let state = self.shared.lock();
        state.committed.contains_key(&hash) || state.pending.contains_key(&hash)
    }

    fn offload(&mut self, job: OffloadJob) {
        {
            let mut state = self.shared.lock();
            *state.pending.entry(job.key.hash).or_default() += 1;
            state.outstanding += 1;
        }
        self.submit(Job::Offload(job));
    }

    fn load(&mut self, job: LoadJob) {
        self.shared.lock().outstanding += 1;
        self.submit(Job::Load(job));
    }

    fn completed_loads(&mut self) -> Vec<LoadDone> {
        std::mem::take(&mut self.shared.lock().done)
    }

    fn flush(&mut self) {
        let mut state = self.shared.lock();
        while state.outstanding > 0 {
            // The timeout only re-checks that the thread is alive (see `submit`).
            if self.worker.as_ref().is_none_or(|w| w.is_finished()) {
                return;
            }
            state = self
                .shared
                .idle
                .wait_timeout(state, Duration::from_millis(100))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    fn counters(&self) -> TierCounters {
        let state = self.shared.lock();
        TierCounters {
            jobs_in_flight: state.outstanding as u64,
            ..state.counters
        }
    }

    fn stored_blocks(&self) -> Vec<(BlockHash, u32)> {
        let state = self.shared.lock();
        state
            .committed
            .iter()
            .map(|(&hash, &group)| (hash, group))
            .collect()
    }

    fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.shared.lock().events);
    }
}

impl Drop for DiskTier {
    /// Closes the queue; the thread finishes every queued job, then exits.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            // A panic of the thread itself (never of a job: those are caught) has nothing to say.
            let _ = worker.join();
        }
    }
}

/// Puts `block` back on the free list and counts it returned (after the push: a count never runs
/// ahead of the list). An id outside the list (a caller bug `open` cannot rule out) is not pushed.
fn return_block(link: &TierLink, block: BlockId) {
    if (block as usize) < link.free.capacity() {
        link.free.push(block);
        link.returned.fetch_add(1, Ordering::Release);
    }
}

fn unpend(state: &mut State, hash: BlockHash) {
    if let Some(count) = state.pending.get_mut(&hash) {
        *count -= 1;
        if *count == 0 {
            state.pending.remove(&hash);
        }
    }
}

/// Marks `count` jobs finished and wakes `flush` when none is left.
fn finish(state: &mut State, idle: &Condvar, count: usize) {
    state.outstanding -= count;
    if state.outstanding == 0 {
        idle.notify_all();
    }
}

/// The I/O thread's side.
struct Worker {
    store: DiskStore,
    kv: KvBlockIo,
    link: TierLink,
    shared: Arc<Shared>,
    jobs: Receiver<Job>,
    /// Loads taken off the channel, in order.
    loads_queued: VecDeque<LoadJob>,
    /// Copies waiting for their store, oldest first.
    copies: VecDeque<Copy>,
    queued_bytes: usize,
    scratch: Vec<u8>,
    loads: u64,
    misses: u64,
    lost: u64,
}

impl Worker {
    fn run(mut self) {
        loop {
            if self.loads_queued.is_empty() && self.copies.is_empty() {
                match self.jobs.recv() {
                    Ok(job) => self.take(job),
                    Err(mpsc::RecvError) => return, // closed, and nothing left to do
                }
            }
            while let Ok(job) = self.jobs.try_recv() {
                self.take(job);
            }
            match self.loads_queued.pop_front() {
                Some(job) => self.load(job),
                None => self.store_group(),
            }
        }
    }

    /// Takes a job off the channel: an offload is copied out and its block returned at once.
    fn take(&mut self, job: Job) {
        let job = match job {
            Job::Load(job) => return self.loads_queued.push_back(job),
            Job::Offload(job) => job,
        };
        let size = self.kv.slot_bytes();
        let room = self.queued_bytes == 0 || self.queued_bytes + size <= MAX_QUEUED_BYTES;
        let copied = room
            .then(|| {
                catch_unwind(AssertUnwindSafe(|| {
                    let mut data = vec![0; size];
                    // SAFETY: the block of a queued offload is written by no thread (the
                    // protocol `DiskTier::open`'s caller keeps).
                    unsafe { self.kv.read_block(job.block, &mut data) }.map(|()| data)
                }))
            })
            .and_then(|result| result.ok()?.ok());
        return_block(&self.link, job.block);
        match copied {
            Some(data) => {
                self.queued_bytes += data.len();
                self.copies.push_back(Copy { job, data });
            }
            None => {
                self.lost += 1;
                self.finish_jobs(1, |state| unpend(state, job.key.hash));
            }
        }
    }

    /// Stores the oldest queued copies as one group (bounded: see [`MAX_GROUP_BYTES`]).
    fn store_group(&mut self) {
        let most = MAX_GROUP_BLOCKS.min(self.store.capacity());
        let (mut count, mut bytes) = (0, 0);
        for copy in self.copies.iter().take(most) {
            if count > 0 && bytes + copy.data.len() > MAX_GROUP_BYTES {
                break;
            }
            count += 1;
            bytes += copy.data.len();
        }
        let group: Vec<Copy> = self.copies.drain(..count).collect();
        self.queued_bytes -= bytes;
        let stored = catch_unwind(AssertUnwindSafe(|| {
            let blocks: Vec<NewBlock<'_>> = group
                .iter()
                .map(|copy| NewBlock {
                    hash: copy.job.key.hash,
                    parent: copy.job.key.parent,
                    group: copy.job.group,
                    tokens: &copy.job.key.tokens,
                    data: &copy.data,
                })
                .collect();
            self.store.store_group(&blocks)
        }));
        // `false`: already stored. An error or a panic loses the group's copies.
        let stored = match stored {
            Ok(Ok(stored)) => stored,
            Ok(Err(_)) | Err(_) => {
                self.lost += count as u64;
                vec![false; count]
            }
        };
        self.finish_jobs(count, |state| {
            for (copy, stored) in group.into_iter().zip(stored) {
                unpend(state, copy.job.key.hash);
                if stored {
                    state.committed.insert(copy.job.key.hash, copy.job.group);
                    state.events.push(KvEvent::BlockStored {
                        key: copy.job.key,
                        medium: Medium::Disk,
                        group: copy.job.group,
                    });
                }
            }
        });
    }

    fn load(&mut self, job: LoadJob) {
        let (store, kv, copies, scratch) =
            (&mut self.store, &self.kv, &self.copies, &mut self.scratch);
        let fetched = catch_unwind(AssertUnwindSafe(|| -> Result<Fetch> {
            ensure((job.block as usize) < kv.shape().num_blocks, || {
                format!("load into block {} outside the pool", job.block)
            })?;
            // The newest queued copy of the block, if its store has not run yet.
            let queued = copies
                .iter()
                .rev()
                .find(|copy| copy.job.key == job.key && copy.job.group == job.group);
            let data = match queued {
                Some(copy) => &copy.data,
                None => {
                    let key = &job.key;
                    match store.load(key.hash, key.parent, job.group, &key.tokens, scratch)? {
                        Fetch::Verified => &*scratch,
                        other => return Ok(other),
                    }
                }
            };
            // SAFETY: the block of an in-flight load is accessed by no other thread (the protocol
            // `DiskTier::open`'s caller keeps); `data` is a queued copy or was verified against
            // its checksum.
            unsafe { kv.write_block(job.block, data) }?;
            Ok(Fetch::Verified)
        }));
        let outcome = match fetched {
            Ok(Ok(Fetch::Verified)) => {
                self.loads += 1;
                LoadOutcome::Loaded
            }
            Ok(Ok(Fetch::Dropped)) => LoadOutcome::Dropped, // counted by the store
            Ok(Ok(Fetch::Missing)) | Ok(Err(_)) | Err(_) => {
                self.misses += 1;
                LoadOutcome::Dropped
            }
        };
        self.finish_jobs(1, |state| {
            state.done.push(LoadDone {
                block: job.block,
                outcome,
            })
        });
    }

    /// Publishes the store's changes, applies `then`, and marks `count` jobs finished, under one
    /// lock.
    fn finish_jobs(&mut self, count: usize, then: impl FnOnce(&mut State)) {
        let shared = Arc::clone(&self.shared);
        let mut state = shared.lock();
        self.publish(&mut state);
        then(&mut state);
        finish(&mut state, &shared.idle, count);
    }

    /// Publishes the entries the store removed (as `BlockRemoved`) and the counters.
    fn publish(&mut self, state: &mut State) {
        for (hash, group) in self.store.take_removed() {
            state.committed.remove(&hash);
            state.events.push(KvEvent::BlockRemoved {
                hash,
                medium: Medium::Disk,
                group,
            });
        }
        let disk = self.store.counters();
        state.counters = TierCounters {
            offloads: disk.stores,
            loads: self.loads,
            dropped_corrupt: disk.dropped_corrupt,
            load_misses: self.misses,
            evictions: disk.evictions,
            bytes_written: disk.bytes_written,
            bytes_read: disk.bytes_read,
            blocks: self.store.len() as u64,
            offloads_lost: self.lost,
            jobs_in_flight: 0, // `counters()` reads the live count
        };
    }
}
