//! Loom model checks of the lock-free free list: every interleaving of 2–3 threads popping and
//! pushing ends with each id on the list exactly once and never held twice; and of the block pool
//! sharing it with a tier's I/O thread (push, then count in `returned`), where an allocation
//! guided by the pool's clean count never finds the list empty.
//! Run with `RUSTFLAGS="--cfg loom" cargo test --release --test loom_free_list`.
#![cfg(loom)]

use loom::sync::Arc;
use pagedkv::FreeList;

fn drain(list: &FreeList) -> Vec<u32> {
    let mut ids: Vec<u32> = std::iter::from_fn(|| list.pop()).collect();
    ids.sort_unstable();
    ids
}

#[test]
fn two_threads_pop_distinct_ids() {
    loom::model(|| {
        let list = Arc::new(FreeList::full(2).unwrap());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let list = list.clone();
                loom::thread::spawn(move || list.pop())
            })
            .collect();
        let mut got: Vec<u32> = handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![0, 1]);
        assert!(list.pop().is_none());
    });
}

#[test]
fn pop_push_races_keep_every_id_once() {
    loom::model(|| {
        let list = Arc::new(FreeList::full(2).unwrap());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let list = list.clone();
                loom::thread::spawn(move || {
                    if let Some(id) = list.pop() {
                        list.push(id);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(drain(&list), vec![0, 1]);
    });
}

/// The ABA shape: one thread pops A while another pops A and B and pushes A back. The tag must make
/// the first thread's stale exchange fail, so B is never both on the list and held.
#[test]
fn aba_is_prevented_by_the_tag() {
    loom::model(|| {
        let list = Arc::new(FreeList::full(3).unwrap());
        let t1 = {
            let list = list.clone();
            loom::thread::spawn(move || list.pop())
        };
        let t2 = {
            let list = list.clone();
            loom::thread::spawn(move || {
                let a = list.pop();
                let b = list.pop();
                if let Some(a) = a {
                    list.push(a);
                }
                b
            })
        };
        let mut held: Vec<u32> = [t1.join().unwrap(), t2.join().unwrap()]
            .into_iter()
            .flatten()
            .collect();
        let mut all = drain(&list);
        all.append(&mut held);
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2]);
    });
}

#[test]
fn three_threads_pop_and_push() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let list = Arc::new(FreeList::full(2).unwrap());
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let list = list.clone();
                loom::thread::spawn(move || {
                    if let Some(id) = list.pop() {
                        list.push(id);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(drain(&list), vec![0, 1]);
    });
}

/// The block pool with a tier's I/O thread: while the scheduler thread releases a block (a push)
/// and allocates, the I/O thread pushes an offloaded block back and then counts it in `returned`.
/// Every allocation the pool's clean count allows pops a block (`allocate` panics otherwise), and
/// no id is lost or handed out twice.
#[test]
fn an_io_thread_returns_offloaded_blocks_while_the_scheduler_allocates() {
    use pagedkv::BlockPool;
    use std::sync::atomic::Ordering;

    loom::model(|| {
        let mut pool = BlockPool::new(2).unwrap();
        pool.keep_content(1).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        pool.register(a, 7, 0, &[1], 0);
        pool.release(a);
        let job = pool.start_offload().expect("a is cached");
        let link = pool.tier_link();
        let io = loom::thread::spawn(move || {
            link.free.push(job.block);
            link.returned.fetch_add(1, Ordering::Release);
        });
        pool.release(b);
        let mut held: Vec<u32> = std::iter::from_fn(|| pool.allocate()).collect();
        // Its own release counts one clean block (the popped one may be the I/O thread's, on top).
        assert!(!held.is_empty(), "the released block is counted clean");
        io.join().unwrap();
        held.extend(std::iter::from_fn(|| pool.allocate()));
        held.sort_unstable();
        assert_eq!(held, vec![0, 1]);
        pool.check_invariants().unwrap();
    });
}

/// Two blocks come back from the I/O thread, one by one, while the scheduler allocates: each
/// count the pool reads is covered by blocks already on the list.
#[test]
fn returned_counts_never_run_ahead_of_the_list() {
    use pagedkv::BlockPool;
    use std::sync::atomic::Ordering;

    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let mut pool = BlockPool::new(2).unwrap();
        pool.keep_content(1).unwrap();
        for hash in [1, 2] {
            let block = pool.allocate().unwrap();
            pool.register(block, hash, 0, &[hash as u32], 0);
        }
        pool.release(0);
        pool.release(1);
        let jobs = [pool.start_offload().unwrap(), pool.start_offload().unwrap()];
        let link = pool.tier_link();
        let io = loom::thread::spawn(move || {
            for job in jobs {
                link.free.push(job.block);
                link.returned.fetch_add(1, Ordering::Release);
            }
        });
        let mut held: Vec<u32> = std::iter::from_fn(|| pool.allocate()).collect();
        io.join().unwrap();
        held.extend(std::iter::from_fn(|| pool.allocate()));
        held.sort_unstable();
        assert_eq!(held, vec![0, 1]);
        pool.check_invariants().unwrap();
    });
}
