#![cfg(feature = "middleware")]
