//! The fuzz targets of `fuzz/` on the stable toolchain, in every test run: each target's seeds
//! (and the local libFuzzer corpus and crash artifacts, where `tools/fuzz.sh` left any) are
//! replayed, then mutated for a bounded time (`OXIDIFF_FUZZ_SECONDS` per target, default 8).
//!
//! The mutations are libFuzzer's kinds (bit flips, random bytes, inserted and erased runs,
//! copied runs, splices of two seeds, interesting numbers and tokens) from a fixed seed, without
//! coverage feedback: a guard against panics coming back, not a replacement for `tools/fuzz.sh`
//! (coverage-guided, with AddressSanitizer). A finding is written to
//! `fuzz/artifacts/TARGET/replay-*` and named in the failure, so `cargo fuzz run TARGET FILE`
//! reproduces it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[path = "../fuzz/targets/config_json.rs"]
mod config_json;
#[path = "../fuzz/targets/lora_file.rs"]
mod lora_file;
#[path = "../fuzz/targets/png_parameters.rs"]
mod png_parameters;
#[path = "../fuzz/targets/safetensors_header.rs"]
mod safetensors_header;
#[path = "../fuzz/targets/tokenizer_files.rs"]
mod tokenizer_files;

/// The largest input a mutation makes (`tools/fuzz.sh` uses `-max_len=65536`).
const MAX_LEN: usize = 65536;

/// Numbers and tokens that sit on the edges of what the loaders parse: sizes that overflow,
/// non-finite floats, JSON and header syntax.
const TOKENS: &[&[u8]] = &[
    b"0",
    b"-1",
    b"4294967295",
    b"18446744073709551615",
    b"9223372036854775807",
    b"1e308",
    b"1e999",
    b"NaN",
    b"-0",
    b"null",
    b"true",
    b"\"\"",
    b"[]",
    b"{}",
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b"\"",
    b"\\u0000",
    b"\"data_offsets\":[0,4294967295]",
    b"\"shape\":[1000000000,1000000000]",
    b"\"dtype\":\"F16\"",
    b"\"__metadata__\"",
    b"\xff",
    b"\n",
    b"Steps: ",
    b"Size: 100000x100000",
    b"Negative prompt: ",
    b"zTXt",
    b"iTXt",
    b"lora_up",
    b".alpha",
];

/// SplitMix64: a fixed, portable sequence, so a run's inputs are the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One mutation of `input` in place; `others` are the seeds a splice may take from.
fn mutate(rng: &mut Rng, input: &mut Vec<u8>, others: &[Vec<u8>]) {
    let len = input.len();
    match rng.below(9) {
        0 if len > 0 => {
            let at = rng.below(len);
            input[at] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let at = rng.below(len);
            input[at] = rng.next() as u8;
        }
        2 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(8);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            input.splice(at..at, bytes);
        }
        3 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(64));
            input.drain(at..at + n);
        }
        4 if len > 0 => {
            let from = rng.below(len);
            let n = 1 + rng.below((len - from).min(256));
            let run = input[from..from + n].to_vec();
            let at = rng.below(len + 1);
            input.splice(at..at, run);
        }
        5 if !others.is_empty() => {
            let other = &others[rng.below(others.len())];
            if !other.is_empty() {
                let keep = rng.below(len + 1);
                let from = rng.below(other.len());
                input.truncate(keep);
                input.extend_from_slice(&other[from..]);
            }
        }
        6 => {
            let token = TOKENS[rng.below(TOKENS.len())];
            let at = rng.below(len + 1);
            input.splice(at..at, token.iter().copied());
        }
        7 if len >= 4 => {
            // A little-endian u32/u64 edge value over 4 or 8 bytes (lengths in binary headers).
            let edges = [0u64, 1, 0x7fff_ffff, 0xffff_ffff, u64::MAX, 1 << 40];
            let value = edges[rng.below(edges.len())].to_le_bytes();
            let width = if len >= 8 && rng.below(2) == 0 { 8 } else { 4 };
            let at = rng.below(len - width + 1);
            input[at..at + width].copy_from_slice(&value[..width]);
        }
        _ if len > 1 => {
            // Overwrite a run with another run of the same input.
            let n = 1 + rng.below(len.min(32));
            let from = rng.below(len - n + 1);
            let to = rng.below(len - n + 1);
            input.copy_within(from..from + n, to);
        }
        _ => input.push(rng.next() as u8),
    }
    input.truncate(MAX_LEN);
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file directly in `dir` (none when it does not exist).
fn files_in(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

fn seconds_per_target() -> f64 {
    std::env::var("OXIDIFF_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|s: &f64| s.is_finite() && *s >= 0.0)
        .unwrap_or(8.0)
}

/// Runs `target` on `input`; a panic is a finding: the input is kept and the test fails.
fn run_one(name: &str, target: fn(&[u8]), input: &[u8], what: &str) {
    if catch_unwind(AssertUnwindSafe(|| target(input))).is_ok() {
        return;
    }
    let dir = repo().join("fuzz/artifacts").join(name);
    let kept = std::fs::create_dir_all(&dir).and_then(|()| {
        let path = dir.join(format!("replay-{:016x}", fingerprint(input)));
        std::fs::write(&path, input).map(|()| path)
    });
    match kept {
        Ok(path) => panic!(
            "fuzz target {name} panicked on {what}; the input is {} \
             (reproduce: cd fuzz && cargo fuzz run {name} {})",
            path.display(),
            path.display()
        ),
        Err(e) => panic!("fuzz target {name} panicked on {what} (could not keep the input: {e})"),
    }
}

/// FNV-1a of the input, to name a kept finding.
fn fingerprint(input: &[u8]) -> u64 {
    input.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Replays the seeds, corpus and artifacts of `name`, then mutates the seeds until the time
/// is up, and returns how many inputs ran.
fn fuzz(name: &str, target: fn(&[u8])) -> usize {
    let fuzz_dir = repo().join("fuzz");
    let seeds = files_in(&fuzz_dir.join("seeds").join(name));
    assert!(
        !seeds.is_empty(),
        "no seeds in fuzz/seeds/{name}: the replay would only try random bytes"
    );
    let mut pool = seeds.clone();
    pool.extend(files_in(&fuzz_dir.join("corpus").join(name)));
    pool.extend(files_in(&fuzz_dir.join("artifacts").join(name)));
    for (i, input) in pool.iter().enumerate() {
        run_one(name, target, input, &format!("stored input {i}"));
    }
    let budget = Duration::from_secs_f64(seconds_per_target());
    let start = Instant::now();
    let mut rng = Rng(fingerprint(name.as_bytes()));
    let mut runs = pool.len();
    while start.elapsed() < budget {
        let mut input = pool[rng.below(pool.len())].clone();
        for _ in 0..1 + rng.below(6) {
            mutate(&mut rng, &mut input, &seeds);
        }
        run_one(name, target, &input, &format!("mutated input {runs}"));
        runs += 1;
    }
    eprintln!(
        "fuzz {name}: {runs} inputs in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    runs
}

#[test]
fn safetensors_headers_from_a_stranger_never_panic() {
    assert!(fuzz("safetensors_header", safetensors_header::run) > 0);
}

#[test]
fn config_files_from_a_stranger_never_panic() {
    assert!(fuzz("config_json", config_json::run) > 0);
}

#[test]
fn tokenizer_folders_from_a_stranger_never_panic() {
    assert!(fuzz("tokenizer_files", tokenizer_files::run) > 0);
}

#[test]
fn png_parameters_from_a_stranger_never_panic() {
    assert!(fuzz("png_parameters", png_parameters::run) > 0);
}

#[test]
fn lora_files_from_a_stranger_never_panic() {
    assert!(fuzz("lora_file", lora_file::run) > 0);
}

#[test]
fn the_mutator_changes_inputs_and_respects_the_length_limit() {
    let mut rng = Rng(7);
    let seed = b"{\"a\": 1}".to_vec();
    let mut changed = 0;
    for _ in 0..200 {
        let mut input = seed.clone();
        mutate(&mut rng, &mut input, std::slice::from_ref(&seed));
        changed += usize::from(input != seed);
        assert!(input.len() <= MAX_LEN);
    }
    assert!(
        changed > 150,
        "only {changed} of 200 mutations changed the input"
    );
    let mut long = vec![0u8; MAX_LEN];
    for _ in 0..50 {
        mutate(&mut rng, &mut long, &[]);
        assert!(long.len() <= MAX_LEN);
    }
}
