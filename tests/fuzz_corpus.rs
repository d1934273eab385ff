//! The fuzz targets' logic under `cargo test`, on stable: every file of the
//! committed seed corpus (`fuzz/seeds/{model,codec}/`) and a batch of
//! pseudo-random inputs run through both targets.
//!
//! `FUZZ_CORPUS_RANDOM` sets the number of pseudo-random inputs per target
//! (default 150). `cargo test --test fuzz_corpus -- --ignored` rewrites the
//! generated part of the seed corpus.

mod fuzzing;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fuzzing::{ModelStats, Rng, run_codec, run_model};

const DEFAULT_RANDOM: usize = 150;

fn seeds_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

fn seed_files(target: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(seeds_dir(target))
        .expect("the seed corpus directory")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn random_inputs() -> usize {
    std::env::var("FUZZ_CORPUS_RANDOM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_RANDOM)
}

/// The `i`th pseudo-random input of a stream seeded with `seed`: 0–1023
/// bytes.
fn random_input(rng: &mut Rng) -> Vec<u8> {
    let len = usize::try_from(rng.next_u64() % 1024).expect("below 1024");
    rng.bytes(len)
}

fn print_stats(label: &str, stats: &ModelStats) {
    let parts: Vec<String> = stats
        .named()
        .into_iter()
        .map(|(name, n)| format!("{name}={n}"))
        .collect();
    println!("{label}: {}", parts.join(" "));
}

#[test]
fn model_seed_corpus() {
    let started = Instant::now();
    let files = seed_files("model");
    assert!(files.len() >= 20, "the model seed corpus has {} files", files.len());
    let mut total = ModelStats::default();
    for f in &files {
        println!("model seed {}", f.display());
        total.add(&run_model(&fs::read(f).expect("a seed file")));
    }
    println!(
        "model: {} seed executions in {:.2?}",
        files.len(),
        started.elapsed()
    );
    print_stats("model seeds reached", &total);
    // The corpus reaches every path the model counts.
    for (name, n) in total.named() {
        assert!(n > 0, "no model seed reaches {name}");
    }
}

#[test]
fn codec_seed_corpus() {
    let started = Instant::now();
    let files = seed_files("codec");
    assert!(files.len() >= 20, "the codec seed corpus has {} files", files.len());
    for f in &files {
        println!("codec seed {}", f.display());
        run_codec(&fs::read(f).expect("a seed file"));
    }
    println!(
        "codec: {} seed executions in {:.2?}",
        files.len(),
        started.elapsed()
    );
}

#[test]
fn model_pseudo_random_inputs() {
    let started = Instant::now();
    let n = random_inputs();
    let mut rng = Rng(0x6d6f_6465_6c00_0001);
    let mut total = ModelStats::default();
    for i in 0..n {
        let input = random_input(&mut rng);
        println!("model random input {i}: {} bytes", input.len());
        total.add(&run_model(&input));
    }
    println!(
        "model: {n} pseudo-random executions in {:.2?}",
        started.elapsed()
    );
    print_stats("model random inputs reached", &total);
}

#[test]
fn codec_pseudo_random_inputs() {
    let started = Instant::now();
    let n = random_inputs();
    let mut rng = Rng(0x636f_6465_6300_0001);
    for i in 0..n {
        let input = random_input(&mut rng);
        println!("codec random input {i}: {} bytes", input.len());
        run_codec(&input);
    }
    println!(
        "codec: {n} pseudo-random executions in {:.2?}",
        started.elapsed()
    );
}
