//! Why a set of CRIU images must not be restored: the typed error of
//! [`validate_restore_paths`](super::validate_restore_paths).

use std::fmt;
use std::io;
use std::path::PathBuf;

use crate::sys::SyscallError;

/// What the restore would do with a path named by the images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathOp {
    /// Create a ghost file or directory (a deleted-but-open file, a deleted cwd or root) as
    /// host root, later remove it again (`criu/files-reg.c` `create_ghost`, `clean_one_remap`).
    CreateGhost,
    /// Re-open a file by its path inside the restored tree (file descriptors, cwd, root,
    /// executable, file mappings, fifos).
    OpenFile,
    /// Mount on this mount point.
    MountAt,
    /// Re-create the deleted source of a bind mount as host root, then remove it.
    RecreateBindSource,
    /// Extract a member of a tmpfs archive as host root (`tar --extract`).
    ExtractTmpfs,
    /// Bind a unix socket (creating missing dirs for a deleted one).
    BindSocket,
    /// Remove a stale unix socket file before binding.
    UnlinkSocket,
    /// Set up the mount tree (mount image itself).
    BuildMounts,
    /// Re-create a hard link CRIU made at dump time (`--link-remap`).
    LinkRemap,
    /// Re-create a pty in the fresh devpts instance, by index.
    OpenPty,
}

impl fmt::Display for PathOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathOp::CreateGhost => "creating ghost file",
            PathOp::OpenFile => "opening",
            PathOp::MountAt => "mounting at",
            PathOp::RecreateBindSource => "re-creating bind-mount source",
            PathOp::ExtractTmpfs => "extracting tmpfs member",
            PathOp::BindSocket => "binding unix socket",
            PathOp::UnlinkSocket => "unlinking unix socket",
            PathOp::BuildMounts => "building the mount tree for",
            PathOp::LinkRemap => "re-creating link remap",
            PathOp::OpenPty => "re-creating pty",
        })
    }
}

/// What is wrong with a path (or with the image that names it). `at` fields name the
/// offending component's path, as far as it was resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnsafeKind {
    /// A `..` component.
    DotDot,
    /// A NUL byte inside the path.
    Nul,
    /// Not in the expected form (empty, not starting with `/` where CRIU expects it).
    Malformed,
    /// Longer than this check accepts (CRIU silently truncates paths near `PATH_MAX`).
    TooLong {
        /// Bytes.
        len: usize,
    },
    /// A component that exists as a symbolic link.
    Symlink {
        /// The component's path.
        at: String,
    },
    /// A component that exists but is not a directory.
    NotDirectory {
        /// The component's path.
        at: String,
    },
    /// A parent that does not exist, where CRIU would not create it.
    MissingParent {
        /// The first missing component.
        at: String,
    },
    /// The name CRIU creates already exists (as something it would follow, reuse or fail on).
    Exists {
        /// The path.
        at: String,
    },
    /// A path into `/proc` through a magic link (`self`, `<pid>/cwd|root|exe|fd/*|...`),
    /// or a creation inside a procfs mount.
    Procfs {
        /// The component's path.
        at: String,
    },
    /// Resolution left the restore root's file system (something is mounted inside it).
    CrossesMount {
        /// The component's path.
        at: String,
    },
    /// More than 40 symbolic links followed.
    TooManySymlinks,
    /// The path is not under the mount point of the mount it names.
    OutsideMount {
        /// The mount's id.
        mnt_id: i32,
    },
    /// A mount id that the mount image does not hold.
    UnknownMount {
        /// The id.
        mnt_id: i32,
    },
    /// A mount CRIU would take from the host (external, plugin) instead of creating it.
    ExternalMount {
        /// The mount's id.
        mnt_id: u32,
    },
    /// A file system whose content this check cannot see (only the root, tmpfs, proc and
    /// devpts are modelled).
    UnsupportedFs {
        /// CRIU's `fstype` number.
        fstype: u32,
    },
    /// A tmpfs mount without its content archive.
    MissingArchive {
        /// The image CRIU would read.
        image: String,
    },
    /// More than one mount namespace (sandboxes have exactly one).
    SeveralMountNamespaces,
    /// A device node other than the pseudo devices a container `/dev` holds.
    Device {
        /// Major number.
        major: u32,
        /// Minor number.
        minor: u32,
    },
    /// A tar member kind CRIU's archives never hold, or a hard link to a missing member.
    BadArchiveMember,
    /// An archive with more members than this check reads.
    TooManyMembers,
    /// A remap kind the validator refuses (link remaps need `--link-remap`, never given).
    Remap {
        /// CRIU's remap type number.
        remap_type: u32,
    },
    /// A remap for a file id that `files.img` does not hold.
    UnknownFile {
        /// The id.
        id: u32,
    },
    /// A pty whose index CRIU may not reach: it opens `ptmx` at most `tries` times to be
    /// handed it out (see `images/ttys.rs`).
    PtyOutOfReach {
        /// The pty's index.
        index: u32,
        /// CRIU's limit on opens ([`PTY_OPEN_TRIES`](super::PTY_OPEN_TRIES)).
        tries: u32,
    },
}

impl fmt::Display for UnsafeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnsafeKind::DotDot => write!(f, "it has a `..` component"),
            UnsafeKind::Nul => write!(f, "it has a NUL byte"),
            UnsafeKind::Malformed => write!(f, "it is not in the form criu writes"),
            UnsafeKind::TooLong { len } => write!(f, "it is {len} bytes long"),
            UnsafeKind::Symlink { at } => write!(f, "{at:?} is a symbolic link"),
            UnsafeKind::NotDirectory { at } => write!(f, "{at:?} is not a directory"),
            UnsafeKind::MissingParent { at } => write!(f, "{at:?} does not exist"),
            UnsafeKind::Exists { at } => write!(f, "{at:?} already exists"),
            UnsafeKind::Procfs { at } => write!(f, "{at:?} goes through procfs"),
            UnsafeKind::CrossesMount { at } => write!(f, "{at:?} is on another mount"),
            UnsafeKind::TooManySymlinks => write!(f, "it follows more than 40 symbolic links"),
            UnsafeKind::OutsideMount { mnt_id } => write!(f, "it is outside mount {mnt_id}"),
            UnsafeKind::UnknownMount { mnt_id } => write!(f, "mount {mnt_id} is not in the images"),
            UnsafeKind::ExternalMount { mnt_id } => write!(f, "mount {mnt_id} comes from the host"),
            UnsafeKind::UnsupportedFs { fstype } => {
                write!(f, "file system type {fstype} is not checked")
            }
            UnsafeKind::MissingArchive { image } => write!(f, "{image} is missing"),
            UnsafeKind::SeveralMountNamespaces => write!(f, "there are several mount namespaces"),
            UnsafeKind::Device { major, minor } => {
                write!(f, "device {major}:{minor} is not allowed")
            }
            UnsafeKind::BadArchiveMember => write!(f, "the archive member is not a plain one"),
            UnsafeKind::TooManyMembers => write!(f, "the archive has too many members"),
            UnsafeKind::Remap { remap_type: 0 } => {
                write!(f, "link remaps (dumped with --link-remap) are refused")
            }
            UnsafeKind::Remap { remap_type } => write!(f, "remap type {remap_type} is unknown"),
            UnsafeKind::UnknownFile { id } => write!(f, "file {id:#x} is not in files.img"),
            UnsafeKind::PtyOutOfReach { index, tries } => write!(
                f,
                "criu re-creates a pty by opening ptmx at most {tries} times, so only indices \
                 below {tries} are restorable and this one is {index}"
            ),
        }
    }
}

/// Why [`validate_restore_paths`](super::validate_restore_paths) refused the images. Nothing
/// was created or changed: the check only reads the images and looks paths up.
#[derive(Debug, thiserror::Error)]
pub enum UnsafeImagePath {
    /// A path the restore would use is unsafe, or the images ask for something this check
    /// refuses.
    #[error("{op} {path:?} (from {image}) is refused: {kind}")]
    Unsafe {
        /// The image file naming the path (file name in the images dir).
        image: String,
        /// What CRIU would do with it.
        op: PathOp,
        /// The path as the image writes it (lossy UTF-8).
        path: String,
        /// What is wrong.
        kind: UnsafeKind,
    },
    /// An image could not be read.
    #[error("cannot read criu image {}", image.display())]
    ReadImage {
        /// The image file.
        image: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An image is not in the format CRIU writes (magic, framing, protobuf, tar).
    #[error("criu image {} is malformed at byte {offset}: {what}", image.display())]
    DecodeImage {
        /// The image file.
        image: PathBuf,
        /// Byte offset in the file (or in the decompressed archive).
        offset: u64,
        /// What was wrong.
        what: &'static str,
    },
    /// The restore root could not be opened.
    #[error("cannot open the restore root {}", root.display())]
    OpenRoot {
        /// The root.
        root: PathBuf,
        /// The syscall error.
        #[source]
        source: SyscallError,
    },
    /// Looking a path up beneath the root failed for another reason than its absence.
    #[error("cannot look up {path:?} beneath the restore root")]
    Lookup {
        /// The path, relative to the root.
        path: String,
        /// The syscall error.
        #[source]
        source: SyscallError,
    },
}

impl UnsafeImagePath {
    /// Whether the images themselves are to blame (an unsafe path, a malformed image), as
    /// opposed to the machine (an I/O error, a failed lookup): the same images will be
    /// refused again.
    pub fn is_image_fault(&self) -> bool {
        matches!(
            self,
            UnsafeImagePath::Unsafe { .. } | UnsafeImagePath::DecodeImage { .. }
        )
    }
}
