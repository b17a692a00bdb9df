//! Helpers shared by this crate's integration tests (each test binary uses a part of them).
#![allow(dead_code)]

pub mod btrfs;
