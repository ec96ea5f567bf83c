//! Loom model checks of the lock-free free list: every interleaving of 2–3 threads popping and
//! pushing ends with each id on the list exactly once and never held twice.
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
