//! The disk tier's store: round trip, reopen, corruption and truncation (dropped, never served),
//! another identity (cleared), capacity eviction, and a crash test: a child process (this test
//! binary re-executed) storing blocks in a loop is SIGKILLed at random points, 20 times; after
//! every kill the tier reopens and every block it serves has exactly the bytes that were written.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pagedkv::disk::DiskStore;
use pagedkv::lru::EvictionPolicy;
use rand::Rng;

const SLOT: usize = 4096;
const ID: &[u8] = b"model-a/f16/bs16";

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagedkv-disk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The bytes, tokens and parent of test block `i`: all derived from `i`, so a reader can check.
fn block(i: u64) -> (u128, u128, Vec<u32>, Vec<u8>) {
    let data: Vec<u8> = (0..SLOT).map(|b| (i as usize * 31 + b * 7) as u8).collect();
    let tokens = vec![i as u32, i as u32 + 1, i as u32 + 2, i as u32 + 3];
    (1000 + i as u128, i as u128, tokens, data)
}

fn open(dir: &std::path::Path, slots: u64) -> DiskStore {
    DiskStore::open(dir, ID, SLOT, slots * SLOT as u64, EvictionPolicy::Slru)
        .unwrap()
        .0
}

fn store(s: &mut DiskStore, i: u64) -> bool {
    let (hash, parent, tokens, data) = block(i);
    s.store(hash, parent, b"", &tokens, &data).unwrap()
}

/// Loads block `i`; if served, asserts its bytes are exactly those written.
fn load(s: &mut DiskStore, i: u64) -> bool {
    let (hash, parent, tokens, data) = block(i);
    let mut out = vec![0; SLOT];
    let served = s.load(hash, parent, b"", &tokens, &mut out).unwrap();
    if served {
        assert_eq!(out, data, "block {i} served with other bytes");
    }
    served
}

#[test]
fn blocks_round_trip_and_survive_a_reopen() {
    let dir = fresh_dir("roundtrip");
    let mut s = open(&dir, 8);
    for i in 0..5 {
        assert!(store(&mut s, i));
    }
    assert!(!store(&mut s, 3), "a stored hash is not stored twice");
    assert!(load(&mut s, 2));
    let (hash, parent, tokens, _) = block(2);
    let mut out = vec![0; SLOT];
    assert!(
        !s.load(hash, parent, b"other salt", &tokens, &mut out)
            .unwrap(),
        "another salt never shares"
    );
    assert!(
        !s.load(hash, parent, b"", &[9, 9, 9, 9], &mut out).unwrap(),
        "other tokens never match"
    );
    drop(s);
    let (mut s, opened) =
        DiskStore::open(&dir, ID, SLOT, 8 * SLOT as u64, EvictionPolicy::Slru).unwrap();
    assert_eq!(
        (opened.recovered, opened.cleared),
        (4, false),
        "5 stored, block 2 dropped by the mismatched salt"
    );
    for i in [0, 1, 3, 4] {
        assert!(load(&mut s, i), "block {i} after reopen");
    }
    assert!(!load(&mut s, 2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_and_truncated_blocks_are_dropped_never_served() {
    let dir = fresh_dir("corrupt");
    let mut s = open(&dir, 8);
    for i in 0..4 {
        store(&mut s, i);
    }
    drop(s);
    // Slots are taken lowest first: block i is in slot i. Flip a byte of block 1, cut block 3 short.
    let data_path = dir.join("blocks.dat");
    let mut bytes = std::fs::read(&data_path).unwrap();
    assert_eq!(&bytes[SLOT..2 * SLOT], block(1).3.as_slice());
    bytes[SLOT + 100] ^= 0xff;
    bytes.truncate(3 * SLOT + 10);
    std::fs::write(&data_path, &bytes).unwrap();
    let mut s = open(&dir, 8);
    assert!(!load(&mut s, 1), "flipped byte");
    assert!(!load(&mut s, 3), "truncated");
    assert!(
        load(&mut s, 0) && load(&mut s, 2),
        "the intact blocks are served"
    );
    assert_eq!(s.counters().dropped_corrupt, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tier_of_another_identity_is_cleared() {
    let dir = fresh_dir("identity");
    let mut s = open(&dir, 4);
    store(&mut s, 0);
    drop(s);
    let (mut s, opened) = DiskStore::open(
        &dir,
        b"model-b/f16/bs16",
        SLOT,
        4 * SLOT as u64,
        EvictionPolicy::Slru,
    )
    .unwrap();
    assert_eq!((opened.recovered, opened.cleared), (0, true));
    assert!(!load(&mut s, 0));
    assert!(
        DiskStore::open(&dir, ID, SLOT, 10, EvictionPolicy::Lru).is_err(),
        "no slot fits"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_full_tier_evicts_never_loaded_blocks_first() {
    let dir = fresh_dir("evict");
    let mut s = open(&dir, 4);
    for i in 0..4 {
        store(&mut s, i);
    }
    assert!(load(&mut s, 0));
    store(&mut s, 4);
    store(&mut s, 5);
    assert_eq!(s.len(), 4);
    assert!(load(&mut s, 0), "the loaded block stays");
    assert!(
        !load(&mut s, 1) && !load(&mut s, 2),
        "the oldest never-loaded blocks went"
    );
    assert_eq!(s.counters().evictions, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

const CHILD_ENV: &str = "PAGEDKV_DISK_CRASH_CHILD";

/// The writer: stores blocks `start..` forever, logging `B i` before and `A i` after each store.
fn crash_child(dir: &str, start: u64) -> ! {
    let mut s = open(&PathBuf::from(dir), 6);
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(format!("{dir}/log"))
        .unwrap();
    for i in start.. {
        log.write_all(format!("B {i}\n").as_bytes()).unwrap();
        store(&mut s, i);
        log.write_all(format!("A {i}\n").as_bytes()).unwrap();
    }
    unreachable!()
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
