//! Placeholder; see crate docs once implemented.
#![warn(missing_docs)]
