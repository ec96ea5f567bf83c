//! The disk store under SIGKILL: a child process (this test binary re-executed) storing groups of
//! random sizes in a loop is killed at random points, 20 times; after every kill the tier reopens
//! and every block it serves has exactly the bytes that were written.
//!
//! Its own binary: spawning a child forks this process, and between the fork and the exec the
//! child holds a copy of every open file description, with the redb index's locks on them. A test
//! in the same process closing an index and reopening it in that window found it "already open"
//! (`disk_store.rs`'s corrupted-index test failed so about once in 4 runs of the binary); cargo
//! runs test binaries one after another.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pagedkv::memory::eviction::EvictionPolicy;
use pagedkv::tier::disk::DiskStore;
use rand::Rng;

#[path = "support/disk_blocks.rs"]
#[allow(dead_code)] // each binary uses part of it
mod support;
use support::*;

const CHILD_ENV: &str = "PAGEDKV_DISK_CRASH_CHILD";

/// The writer: stores blocks `start..` forever in groups of 1 to 6 blocks (the tier's capacity:
/// a group may evict every block), logging `B i` before and `A i` after each group of first block
/// `i`.
fn crash_child(dir: &str, start: u64) -> ! {
    let mut s = open(&PathBuf::from(dir), 6);
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(format!("{dir}/log"))
        .unwrap();
    let mut rng = rand::rng();
    let mut i = start;
    loop {
        let ids: Vec<u64> = (i..i + rng.random_range(1..=6)).collect();
        log.write_all(format!("B {i}\n").as_bytes()).unwrap();
        store_group(&mut s, &ids);
        log.write_all(format!("A {i}\n").as_bytes()).unwrap();
        i += ids.len() as u64;
    }
}

#[test]
fn sigkill_at_random_points_never_serves_a_wrong_block() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let (dir, start) = spec.split_once(',').unwrap();
        crash_child(dir, start.parse().unwrap());
    }
    let dir = fresh_dir("crash");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rng();
    let (mut mid_write, mut served_total) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    for run in 0..20u64 {
        let start = run * 10_000;
        let _ = std::fs::remove_file(dir.join("log"));
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                "sigkill_at_random_points_never_serves_a_wrong_block",
                "--nocapture",
            ])
            .env(CHILD_ENV, format!("{},{start}", dir.display()))
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.random_range(20..120)));
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        assert!(
            Instant::now() < deadline,
            "the crash test overran its time limit"
        );
        let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        if log.lines().last().is_some_and(|l| l.starts_with('B')) {
            mid_write += 1;
        }
        let (mut s, _) =
            DiskStore::open(&dir, ID, SLOT, 6 * SLOT as u64, EvictionPolicy::Slru).unwrap();
        let hashes: Vec<u128> = s.hashes().collect();
        for hash in hashes {
            let i = (hash - 1000) as u64;
            if load(&mut s, i) {
                served_total += 1;
            }
        }
    }
    println!(
        "crash test: 20 kills, {mid_write} mid-write, {served_total} blocks served and verified"
    );
    assert!(
        served_total > 0,
        "the writer never committed a block: the test proved nothing"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
