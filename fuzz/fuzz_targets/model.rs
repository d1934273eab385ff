//! Operation sequences on the inbox, the outbox and the idempotency keys,
//! with time steps and reopens, checked against an in-memory model. The logic lives in `tests/fuzzing/`, which `cargo test`
//! also runs over the seed corpus.
#![no_main]

#[path = "../../tests/fuzzing/mod.rs"]
#[allow(dead_code, unused_imports)]
mod fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzzing::run_model(data);
});
