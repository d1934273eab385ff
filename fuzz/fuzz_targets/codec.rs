//! Arbitrary and mutated bytes in every record table, then every reader and
//! writer: no panic, and errors are `Corrupted`. The logic lives in
//! `tests/fuzzing/`, which `cargo test` also runs over the seed corpus.
#![no_main]

#[path = "../../tests/fuzzing/mod.rs"]
#[allow(dead_code, unused_imports)]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzzing::run_codec(data);
});
