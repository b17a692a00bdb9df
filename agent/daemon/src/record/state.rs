//! Lifecycle of a sandbox: the state enum with its `can_*` guards is the wire type
//! [`belayer_ipc::SandboxState`]; the daemon persists it in `state.json` after every verb.

pub use belayer_ipc::SandboxState;
