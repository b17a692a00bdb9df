//! The hardened tree builder shared by [`install_upper`](crate::install_upper) (tar
//! archives), [`install_image`](crate::install_image) (image tar streams) and
//! [`materialize_layer`](crate::layer::materialize_layer) (layer manifests and blobs): it
//! creates checked members in a fresh directory and never writes outside it.
//!
//! Nothing is ever resolved through a symlink: every parent directory is opened with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`
//! relative to the target, every leaf is created with an `*at` call relative to that parent
//! fd (`O_CREAT | O_EXCL | O_NOFOLLOW`, `mkdirat`, `symlinkat`, `mknodat`, `linkat`), and
//! metadata is set through the new fd or with `AT_SYMLINK_NOFOLLOW`. Names, entry types,
//! devices, extended attributes and sizes are checked by the callers with
//! [`parse_name`] and [`check_xattr`] before anything is created.
//!
//! Files: `member` (decoded members and their checks), `content` (where file content comes
//! from), `installer` (creating members beneath the target), `error` and `limits` (the
//! [`InstallError`], [`InstallLimits`] and [`InstallStats`] types, re-exported by
//! [`crate::install`] and the crate root under their public names).

mod content;
mod error;
mod installer;
mod limits;
mod member;

pub(crate) use content::{ContentSource, RegularData};
pub use error::InstallError;
pub(crate) use error::{lossy, path_of};
pub(crate) use installer::{open_empty_target, Installer};
pub use limits::{InstallLimits, InstallStats};
pub(crate) use member::{
    check_device, check_symlink_target, check_xattr, name_error, parse_hardlink_target, parse_name,
    Member, MemberKind,
};
