//! The fuzz targets' logic under `cargo test`, on stable: every file of the
//! committed seed corpus (`fuzz/seeds/{model,codec}/`), files of the
//! committed corpus the fuzzer found (`fuzz/corpus-min/{model,codec}/`,
//! minimised), and a batch of pseudo-random inputs, run through both
//! targets.
//!
//! `IDEMSTORE_FUZZ_CORPUS` says which files of the found corpus are
//! replayed: by default a fixed sample, every [`DEFAULT_CORPUS_STEP`]th file
//! by name (the whole corpus takes minutes in a debug build); `all` replays
//! every file (CI does, in a release build), a number `n` every `n`th.
//! `FUZZ_CORPUS_RANDOM` sets the number of pseudo-random inputs per target
//! (default 60). `cargo test --test fuzz_corpus -- --ignored` rewrites the
//! generated part of the seed corpus.

mod common;
mod fuzzing;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fuzzing::{ModelStats, Rng, run_codec, run_model};

const DEFAULT_RANDOM: usize = 60;

/// One file in this many of the found corpus is replayed by default.
const DEFAULT_CORPUS_STEP: usize = 32;

fn seeds_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
}

/// Every `step`th file of the found corpus is replayed: `IDEMSTORE_FUZZ_CORPUS`
/// (`all` is 1), [`DEFAULT_CORPUS_STEP`] by default.
fn corpus_step() -> usize {
    match std::env::var("IDEMSTORE_FUZZ_CORPUS") {
        Ok(v) if v == "all" => 1,
        Ok(v) => v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| {
            panic!("IDEMSTORE_FUZZ_CORPUS is `all` or a step above 0, not {v:?}")
        }),
        Err(_) => DEFAULT_CORPUS_STEP,
    }
}

/// The files of `dir`, by name (none if it is absent).
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// The inputs replayed for `target`: every seed, and every
/// [`corpus_step`]th file, by name, of the corpus the fuzzer found and
/// `cargo fuzz cmin` minimised (`fuzz/corpus-min/`, committed; absent for a
/// target not fuzzed yet).
struct Inputs {
    files: Vec<PathBuf>,
    seeds: usize,
    corpus: usize,
    step: usize,
}

impl Inputs {
    fn describe(&self) -> String {
        format!(
            "{} inputs ({} seeds, {} of the {} files of the found corpus: {})",
            self.files.len(),
            self.seeds,
            self.files.len() - self.seeds,
            self.corpus,
            match self.step {
                1 => "every file".to_owned(),
                n => format!("one in {n}, by name"),
            }
        )
    }
}

fn seed_files(target: &str) -> Inputs {
    let seeds = seeds_dir(target);
    assert!(
        seeds.is_dir(),
        "the seed corpus directory {}",
        seeds.display()
    );
    let mut files = files_in(&seeds);
    let seed_count = files.len();
    let found = files_in(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus-min")
            .join(target),
    );
    let step = corpus_step();
    let corpus = found.len();
    files.extend(found.into_iter().step_by(step));
    Inputs {
        files,
        seeds: seed_count,
        corpus,
        step,
    }
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
fn the_store_agrees_with_the_model_on_every_seed_and_the_seeds_reach_every_path() {
    let started = Instant::now();
    let inputs = seed_files("model");
    assert!(
        inputs.seeds >= 20,
        "the model seed corpus has {} files",
        inputs.seeds
    );
    let mut total = ModelStats::default();
    for f in &inputs.files {
        println!("model seed {}", f.display());
        total.add(&run_model(&fs::read(f).expect("a seed file")));
    }
    common::report(&format!(
        "fuzz model: {} replayed in {:.2?}",
        inputs.describe(),
        started.elapsed()
    ));
    print_stats("model seeds reached", &total);
    // The corpus reaches every path the model counts.
    for (name, n) in total.named() {
        assert!(n > 0, "no model seed reaches {name}");
    }
}

#[test]
fn damaged_records_from_every_codec_seed_are_errors_not_panics() {
    let started = Instant::now();
    let inputs = seed_files("codec");
    assert!(
        inputs.seeds >= 20,
        "the codec seed corpus has {} files",
        inputs.seeds
    );
    for f in &inputs.files {
        println!("codec seed {}", f.display());
        run_codec(&fs::read(f).expect("a seed file"));
    }
    common::report(&format!(
        "fuzz codec: {} replayed in {:.2?}",
        inputs.describe(),
        started.elapsed()
    ));
}

#[test]
fn the_store_agrees_with_the_model_on_pseudo_random_inputs() {
    let started = Instant::now();
    let n = random_inputs();
    let mut rng = Rng(0x6d6f_6465_6c00_0001);
    let mut total = ModelStats::default();
    for i in 0..n {
        let input = random_input(&mut rng);
        println!("model random input {i}: {} bytes", input.len());
        total.add(&run_model(&input));
    }
    common::report(&format!(
        "fuzz model: {n} pseudo-random executions in {:.2?}",
        started.elapsed()
    ));
    print_stats("model random inputs reached", &total);
}

#[test]
fn damaged_records_from_pseudo_random_inputs_are_errors_not_panics() {
    let started = Instant::now();
    let n = random_inputs();
    let mut rng = Rng(0x636f_6465_6300_0001);
    for i in 0..n {
        let input = random_input(&mut rng);
        println!("codec random input {i}: {} bytes", input.len());
        run_codec(&input);
    }
    common::report(&format!(
        "fuzz codec: {n} pseudo-random executions in {:.2?}",
        started.elapsed()
    ));
}

/// Bytes that decode, through `arbitrary`, as chosen operations: for the
/// hand-written seeds. The variant numbers follow the declaration order of
/// `Op`, `How`, `Patch` and `Bytes` in `tests/fuzzing/`.
#[derive(Default)]
struct Encoder(Vec<u8>);

impl Encoder {
    /// The `u32` tag `arbitrary`'s derive maps to variant `i` of `n`.
    fn tag(&mut self, i: u64, n: u64) -> &mut Self {
        let tag = u32::try_from((i << 32).div_ceil(n)).expect("a u32 tag");
        self.0.extend_from_slice(&tag.to_le_bytes());
        self
    }

    fn op(&mut self, i: u64) -> &mut Self {
        self.tag(i, 21)
    }

    fn u8s(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }

    fn some(&mut self) -> &mut Self {
        self.u8s(&[1])
    }

    fn none(&mut self) -> &mut Self {
        self.u8s(&[0])
    }

    /// A `Vec<u8>`: a continuation byte before each element, 0 at the end.
    fn vec(&mut self, items: &[u8]) -> &mut Self {
        for b in items {
            self.u8s(&[1, *b]);
        }
        self.none()
    }

    fn advance(&mut self, secs: u8) -> &mut Self {
        self.op(0).u8s(&[secs])
    }
    fn claim(&mut self, inbox: u8, key: u8) -> &mut Self {
        self.op(1).u8s(&[inbox, key])
    }
    fn claim_with(&mut self, inbox: u8, key: u8, fail: bool, enqueue: Option<u8>) -> &mut Self {
        self.op(2).u8s(&[inbox, key, 7, u8::from(fail)]);
        match enqueue {
            Some(k) => self.some().u8s(&[0, 0, k]),
            None => self.none(),
        }
    }
    fn claim_many(&mut self, inbox: u8, keys: &[u8]) -> &mut Self {
        self.op(3).u8s(&[inbox]).vec(keys)
    }
    fn prune(&mut self, inbox: u8, back: u8) -> &mut Self {
        self.op(4).u8s(&[inbox, back])
    }
    fn enqueue(&mut self, cmd: u8, dest: u8, key: u8) -> &mut Self {
        self.op(5).u8s(&[cmd, dest, key, 2]).none()
    }
    fn claim_due(&mut self, limit: u8, worker: u8) -> &mut Self {
        self.op(7).u8s(&[limit, worker])
    }
    /// `how`: 0 completed, 1 retry(+2 s), 2 give up, 3 unknown, 4 reschedule.
    fn settle(&mut self, pick: u8, stale: bool, how: u64) -> &mut Self {
        self.op(8).u8s(&[pick, u8::from(stale)]).how(how)
    }
    fn mark(&mut self, pick: u8, how: u64) -> &mut Self {
        self.op(9).u8s(&[pick]).how(how)
    }
    fn how(&mut self, how: u64) -> &mut Self {
        self.tag(how, 5);
        match how {
            1 | 4 => self.u8s(&[10]), // offset(10) = +2 s
            3 => self.some().u8s(&[1]),
            _ => self,
        }
    }
    fn requeue(&mut self, pick: u8) -> &mut Self {
        self.op(10).u8s(&[pick, 8])
    }
    fn release_claims(&mut self, back: u8) -> &mut Self {
        self.op(11).u8s(&[back])
    }
    fn purge_finished(&mut self, back: u8) -> &mut Self {
        self.op(12).u8s(&[back])
    }
    fn begin(&mut self, tenant: u8, key: u8, fp: u8) -> &mut Self {
        self.op(13).u8s(&[tenant, key, fp])
    }
    fn complete(&mut self, held: u8) -> &mut Self {
        self.op(14).u8s(&[held, 1])
    }
    fn release_key(&mut self, held: u8) -> &mut Self {
        self.op(15).u8s(&[held])
    }
    fn put(&mut self, tenant: u8, key: u8, fp: u8) -> &mut Self {
        self.op(16).u8s(&[tenant, key, fp, 8])
    }
    fn get(&mut self, tenant: u8, key: u8, back: u8) -> &mut Self {
        self.op(17).u8s(&[tenant, key, back])
    }
    fn purge_expired(&mut self, back: u8) -> &mut Self {
        self.op(18).u8s(&[back])
    }
    fn reopen(&mut self) -> &mut Self {
        self.op(19)
    }
    fn cancel(&mut self, pick: u8) -> &mut Self {
        self.op(20).u8s(&[pick])
    }
}

/// Hand-written model seeds, each with the counter it must reach.
fn hand_model_seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let mut out = Vec::new();
    let mut e = Encoder::default();
    e.claim(0, 0)
        .claim_with(0, 1, false, Some(1))
        .enqueue(0, 0, 2)
        .claim_due(3, 0)
        .begin(0, 0, 0)
        .complete(0)
        .reopen()
        .claim(0, 0)
        .claim_many(1, &[0, 0, 1])
        .enqueue(0, 0, 2)
        .begin(0, 0, 0)
        .reopen()
        .settle(0, false, 0);
    out.push(("hand-reopen", "reopens", e.0));

    let mut e = Encoder::default();
    e.begin(1, 2, 0)
        .advance(15)
        .begin(1, 2, 0)
        .complete(0)
        .complete(1)
        .reopen()
        .begin(1, 2, 0)
        .begin(1, 2, 1);
    out.push(("hand-takeover", "takeovers", e.0));

    let mut e = Encoder::default();
    e.enqueue(1, 1, 3)
        .claim_due(1, 1)
        .settle(0, false, 1)
        .advance(5)
        .claim_due(1, 2)
        .settle(0, true, 0)
        .settle(0, false, 1)
        .reopen()
        .advance(5)
        .claim_due(2, 0)
        .settle(0, false, 0)
        .advance(70)
        .purge_finished(0)
        .enqueue(1, 1, 3);
    out.push(("hand-retries", "retries", e.0));

    let mut e = Encoder::default();
    e.enqueue(0, 0, 0)
        .enqueue(1, 0, 1)
        .claim_due(4, 0)
        .advance(20)
        .release_claims(0)
        .claim_due(4, 1)
        .reopen()
        .settle(0, true, 0)
        .mark(0, 3)
        .requeue(0)
        .mark(1, 2)
        .requeue(200);
    out.push(("hand-crashed-dispatcher", "released", e.0));

    let mut e = Encoder::default();
    e.claim_with(1, 3, true, Some(4))
        .claim_with(1, 3, false, Some(4))
        .claim_with(1, 3, false, None)
        .advance(30)
        .claim(1, 4)
        .prune(1, 10)
        .reopen()
        .claim_with(1, 3, false, None);
    out.push(("hand-effects", "effects_refused", e.0));

    let mut e = Encoder::default();
    e.put(0, 1, 0)
        .begin(0, 1, 1)
        .begin(0, 3, 0)
        .begin(0, 3, 0)
        .release_key(0)
        .begin(0, 3, 0)
        .advance(31)
        .advance(31)
        .advance(10)
        .get(0, 1, 0)
        .purge_expired(0)
        .reopen()
        .begin(0, 1, 1);
    out.push(("hand-expiry", "expired", e.0));

    // Cancel a pending entry, one in doubt, one being dispatched (refused)
    // and a cancelled one again; then purge and reopen with its history.
    let mut e = Encoder::default();
    e.enqueue(0, 0, 0)
        .enqueue(1, 1, 1)
        .enqueue(2, 0, 2)
        .claim_due(2, 0)
        .settle(0, false, 3)
        .settle(1, false, 1)
        .cancel(0)
        .cancel(0)
        .claim_due(1, 1)
        .cancel(1)
        .reopen()
        .cancel(0)
        .advance(5)
        .purge_finished(0);
    out.push(("hand-cancel", "cancelled", e.0));
    out
}

/// Hand-written codec seeds: every patch kind with every kind of bytes.
fn hand_codec_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let patch = |kind: u64, row: u8, bytes: &dyn Fn(&mut Encoder)| {
        let mut e = Encoder::default();
        e.some().tag(kind, 3).u8s(&[row]);
        bytes(&mut e);
        e.none().u8s(&[5]);
        e.0
    };
    let flip = |at: u16, xor: u8| {
        move |e: &mut Encoder| {
            e.tag(1, 5).u8s(&at.to_le_bytes()).u8s(&[xor]);
        }
    };
    let varint = |at: u16, value: u64| {
        move |e: &mut Encoder| {
            e.tag(4, 5).u8s(&at.to_le_bytes()).u8s(&value.to_le_bytes());
        }
    };
    let truncate = |n: u16| {
        move |e: &mut Encoder| {
            e.tag(2, 5).u8s(&n.to_le_bytes());
        }
    };
    let raw = |bytes: &'static [u8]| {
        move |e: &mut Encoder| {
            e.tag(0, 5).vec(bytes);
        }
    };
    let insert = |at: u16, bytes: &'static [u8]| {
        move |e: &mut Encoder| {
            e.tag(3, 5).u8s(&at.to_le_bytes()).vec(bytes);
        }
    };
    // An attempt record: no row patch, the time byte, then one record
    // (behind its continuation byte).
    let attempt = |entry: u8, seq: u8, bytes: &dyn Fn(&mut Encoder)| {
        let mut e = Encoder::default();
        e.none().u8s(&[5]).some().u8s(&[entry, seq]);
        bytes(&mut e);
        e.0
    };
    let inbox = |row: u8, seen_at: i64| {
        let mut e = Encoder::default();
        e.some().tag(2, 3).u8s(&[row]).u8s(&seen_at.to_le_bytes());
        e.none().u8s(&[0]);
        e.0
    };
    vec![
        ("hand-outbox-version", patch(0, 0, &flip(0, 0x03))),
        ("hand-outbox-status", patch(0, 2, &flip(20, 0x07))),
        ("hand-outbox-huge-len", patch(0, 1, &varint(1, u64::MAX))),
        ("hand-outbox-time", patch(0, 3, &varint(18, 1 << 62))),
        ("hand-outbox-truncate", patch(0, 0, &truncate(9))),
        ("hand-outbox-empty", patch(0, 4, &raw(b""))),
        ("hand-outbox-orphan", patch(0, 5, &raw(b"\x01abc"))),
        ("hand-outbox-trailing", patch(0, 1, &insert(400, b"\0\0"))),
        ("hand-idem-version", patch(1, 0, &flip(0, 0x02))),
        ("hand-idem-variant", patch(1, 1, &flip(1, 0x01))),
        ("hand-idem-huge-len", patch(1, 1, &varint(2, u64::MAX))),
        ("hand-idem-truncate", patch(1, 2, &truncate(5))),
        (
            "hand-idem-new-row",
            patch(1, 3, &raw(b"\x01\x00\x04fp-a\x01\x02\x03")),
        ),
        ("hand-inbox-max", inbox(0, i64::MAX)),
        ("hand-inbox-min", inbox(1, i64::MIN)),
        ("hand-inbox-orphan", inbox(2, 0)),
        ("hand-attempt-version", attempt(1, 0, &flip(0, 0x03))),
        ("hand-attempt-time", attempt(2, 0, &varint(2, u64::MAX))),
        ("hand-attempt-truncate", attempt(1, 0, &truncate(4))),
        ("hand-attempt-trailing", attempt(2, 0, &insert(40, b"\0"))),
        (
            "hand-attempt-orphan",
            attempt(5, 1, &raw(b"\x01\x01\x02\x02ok\x00")),
        ),
    ]
}

fn write_seed(target: &str, name: &str, bytes: &[u8]) {
    let path = seeds_dir(target).join(name);
    fs::write(&path, bytes).expect("write a seed file");
}

/// Rewrites the seed corpus: the hand-written seeds, then pseudo-random
/// inputs chosen so that together they reach every counter of the model.
#[test]
#[ignore = "rewrites fuzz/seeds; run by hand after changing the targets"]
fn generate_seeds() {
    for target in ["model", "codec"] {
        let dir = seeds_dir(target);
        if dir.exists() {
            fs::remove_dir_all(&dir).expect("clear the seed directory");
        }
        fs::create_dir_all(&dir).expect("create the seed directory");
    }
    for (name, counter, bytes) in hand_model_seeds() {
        let stats = run_model(&bytes);
        let reached = stats
            .named()
            .into_iter()
            .any(|(c, n)| c == counter && n > 0);
        assert!(reached, "{name} does not reach {counter}: {stats:?}");
        write_seed("model", name, &bytes);
    }
    // Greedy cover: short random inputs, each kept if it reaches a counter
    // no kept input has reached yet, then plain ones up to 30 seeds.
    let mut rng = Rng(0x5eed_5eed_0000_0001);
    let mut reached = ModelStats::default();
    let mut kept = 0;
    for i in 0..400 {
        let len = 16 + usize::try_from(rng.next_u64() % 400).expect("small");
        let bytes = rng.bytes(len);
        let stats = run_model(&bytes);
        let new = stats
            .named()
            .into_iter()
            .zip(reached.named())
            .any(|((_, n), (_, seen))| n > 0 && seen == 0);
        if new || (i % 20 == 0 && kept < 24) {
            reached.add(&stats);
            kept += 1;
            write_seed("model", &format!("random-{i:03}"), &bytes);
        }
    }
    for (name, bytes) in hand_codec_seeds() {
        run_codec(&bytes);
        write_seed("codec", name, &bytes);
    }
    let mut rng = Rng(0x5eed_c0de_c000_0001);
    for i in 0..20 {
        let len = 8 + usize::try_from(rng.next_u64() % 300).expect("small");
        let bytes = rng.bytes(len);
        run_codec(&bytes);
        write_seed("codec", &format!("random-{i:03}"), &bytes);
    }
}
