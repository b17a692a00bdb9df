//! Reading CRIU images, and the check that a restore of them never writes outside the new root
//! ([`validate_restore_paths`]).
//!
//! # Why
//! `criu restore --root <merged>` runs as host root, and part of its work happens from the
//! host's root directory, with paths taken from the images, i.e. chosen by the dumped tree. A
//! sandbox that keeps a file open, deletes it and replaces the deleted file's directory with a
//! symbolic link `/tmp/d -> /srv/host-dir` makes CRIU create `/srv/host-dir/f.cr.1.ghost` (with
//! the sandbox's content and mode) and unlink it again; with a deleted cwd instead, CRIU
//! `mkdir -p`s, `chown`s, `chmod`s and finally `rmdir`s the host directory the path reaches;
//! with an `O_PATH` fd on a deleted symbolic link, CRIU's own ghost of that link becomes the
//! parent of the next ghost, which then stays on the host after the restore. The check resolves every such path beneath the freshly materialized root before CRIU runs. No
//! sandbox process exists at that point, so the tree cannot change between the check and the
//! restore.
//!
//! # What CRIU 4.2 does by path at restore, and how each is covered
//! Contexts: **host** = CRIU's root task in its service mount namespace, root = the host's `/`,
//! paths `<yard>/mnt-<id>/<path>` where `<yard>` is `/tmp/.criu.mntns.XXXXXX` and each mount
//! is its own plain mount (mount engine v2); **chroot** = `chroot(<restored root>)` inside the
//! restored namespace; **task** = a restored task after `setns` into the restored mount
//! namespace (root = the restored root; absolute links and `..` stay inside, magic links do
//! not).
//!
//! Each item: the operation (CRIU source), its context and what it follows, then how it is
//! covered.
//! - **Ghost file** (`files-reg.c` `create_ghost`, `create_ghost_dentry`, `trim_last_parent`):
//!   `open(O_CREAT|O_EXCL)`, `mknod` or `symlink` at `<path>.cr.<id>.ghost`, retried one
//!   ancestor higher on `ENOENT`; then `fchownat`/`fchmodat`/`lutimes` with
//!   `AT_SYMLINK_NOFOLLOW`. Host; follows every parent. *Covered*: every existing component
//!   from the mount's root to the parent a directory, none a link; the name must not exist;
//!   the landing directory is computed as CRIU's retries find it; devices only
//!   [`ALLOWED_CHAR_DEVICES`]; the names created are added to the model, so a later path
//!   through a ghost symlink CRIU itself made is refused too.
//! - **Ghost directory** (deleted cwd or root; `create_ghost`, `mkdirpat`): `mkdir -p` of the
//!   path (`EEXIST` ignored), chown, chmod, and at the end `rmdir`. Host; follows every
//!   component. *Covered*: every existing component a directory (the leaf may be one), none a
//!   link.
//! - **Ghost removal** (`depopulate_roots_yard` → `try_clean_remaps` → `clean_one_remap`, also
//!   on failure): `unlink`/`rmdir` of the same path. Host; follows parents. *Covered* by the
//!   creation check.
//! - **Link remap** (`create_link_remap` at dump with `--link-remap`; `rfi_remap`,
//!   `clean_one_remap` at restore): `linkat` at dump from the tree's root fd (absolute links of
//!   the sandbox resolve from the host root), `link`/`unlink` at restore. *Covered*:
//!   `--link-remap` is never passed; an image holding one is refused.
//! - **Reopen by path** of every regular file, directory, fifo, cwd, root, executable and file
//!   mapping (`open_path`, `do_open_reg`, `fifo.c`, `restore_fs`): `openat(<ns root>, path)`.
//!   Task; follows all but an `O_NOFOLLOW` leaf. *Covered*: no link and no procfs magic link on
//!   the way; a link as the leaf only with `O_NOFOLLOW`.
//! - **Ghost linked to its old name** for that open (`make_parent_dirs_if_need`, `rfi_remap`,
//!   `rm_parent_dirs`): `mkdirat` of parents, `linkat`, `unlinkat`, `rmdir`. Task; parents.
//!   *Covered* by the file's check.
//! - **Unix socket** (`sk-unix.c` `unlink_sk`, `bind_unix_sk`, `bind_on_deleted`): `stat` and
//!   `unlink` of a stale socket file, `bind`; for a deleted one `mkdir` of each literal prefix,
//!   `rename` of an existing file aside and back, `bind`, `unlink`, `rmdir`. Chroot; follows
//!   parents (and the leaf for `stat`). *Covered*: resolved with chroot semantics, links
//!   followed beneath the root, never into procfs; the parent must exist (after the prefixes a
//!   deleted socket's `mkdir`s create); the leaf not a link.
//! - **Tmpfs content** (`filesystems.c` `tmpfs_restore`): `tar --extract --directory
//!   <yard>/mnt-<id>`. Host (GNU tar); follows member parents. *Covered*: absolute and `..`
//!   names, members below links or files, foreign hard links and devices are refused.
//! - **Mount points** (`mount-v2.c` `detect_is_dir`, `move_mount_to_tree`; v1 `do_mount_one`):
//!   `stat` from the host root, `move_mount` inside the new namespace; with
//!   `--mntns-compat-mode` a `mount` at `<yard>/<ns>/<mount point>` from the host root.
//!   *Covered*: an existing directory or file inside its parent mount, reached without links.
//! - **Deleted bind-mount source** (`do_bind_mount_v2`, `remove_source_of_deleted_mount`):
//!   `mkdir` of missing parents, `mkdir`/`open(O_CREAT|O_EXCL)`, later `rmdir`/`unlink`. Host;
//!   parents. *Covered*: parents directories or missing, the source missing, never in procfs.
//! - **External mounts** (`--ext-mount-map`, `get_mp_root`): a bind of a host path the image
//!   names. *Covered*: refused, as are plugin mounts and file systems other than the root,
//!   tmpfs, procfs and devpts.
//! - **Ptys** (`tty.c` `pty_open_ptmx_index`, `devpts_restore`): CRIU mounts a fresh devpts and
//!   opens its `ptmx` until the kernel hands out each dumped index, then the slaves by path
//!   (`/dev/pts/<n>`). Task; nothing created. *Covered* as files: a devpts holds only `ptmx`
//!   and numbered nodes, and nothing may be created in it.
//! - **inotify/fanotify watches** (`fsnotify.c`): `openat(O_PATH)` of a path hint and a
//!   watch. Task; read-only, not checked.
//! - **CRIU's own files**: yard (`mkdtemp`), work dir, log, pidfile: not from the images.
//!
//! Procfs mounts (`/proc`, `/proc/sys`) are recreated fresh: only magic links (`self`,
//! `<pid>/{cwd,root,exe}`, `<pid>/{fd,map_files,ns}/*`) lead out, so a path through one is
//! refused and nothing is ever created in procfs. The sandbox's `/dev` tmpfs is modelled by
//! its archive: ghost files and sockets in `/dev/shm` are checked against it.
//!
//! At dump time CRIU writes by path only link remaps (`create_link_remap`: `linkat` to a path
//! resolved from the tree's `/proc/<pid>/root`, where an absolute link in the sandbox resolves
//! from the host root), and only with `--link-remap`, which [`DumpRequest`](crate::DumpRequest)
//! never passes: such a dump fails instead ("Can't create link remap"). Its other path
//! operations at dump (`fstatat` of file names, `tar --create` of a tmpfs through an fd,
//! socket names through `SIOCUNIXFILE`) only read.
//!
//! # Format
//! `images/wire.rs` reads the framing and the protobuf wire format by field number;
//! `images/entries.rs` holds the table of the few messages and fields used. No `.proto` file or
//! generated code.

mod entries;
mod error;
mod fs;
mod mounts;
mod path;
mod sockets;
#[cfg(test)]
mod testutil;
mod tmpfs;
mod ttys;
mod userns;
mod validate;
mod wire;

pub use error::{PathOp, UnsafeImagePath, UnsafeKind};
pub use mounts::AllowedBind;
pub use sockets::{tcp_connections, SocketImageError, TcpConnection};
pub use tmpfs::ALLOWED_CHAR_DEVICES;
pub use ttys::PTY_OPEN_TRIES;
pub use userns::{rebase_userns_images, userns_uid_map, IdExtent, UsernsImageError};
pub use validate::{validate_restore_paths, validate_restore_paths_allowing, ImagePathReport};
