//! SCM_RIGHTS round trips over real Unix socket pairs with real memfds and pipes.

use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use belayer_ipc::{recv_with_fds, send_with_fds, FdPassError};
use nix::sys::memfd::{memfd_create, MFdFlags};

#[test]
fn memfd_and_pipe_pass_and_are_usable_on_the_other_side() {
    let (a, b) = UnixStream::pair().unwrap();

    let mut memfd = File::from(memfd_create("belayer-ipc-test", MFdFlags::MFD_CLOEXEC).unwrap());
    memfd.write_all(b"weights live here").unwrap();
    let (pipe_rx, pipe_tx) = nix::unistd::pipe().unwrap();

    send_with_fds(&a, b"two fds", &[memfd.as_fd(), pipe_rx.as_fd()]).unwrap();
    // Our copies close; the receiver's duplicates keep the objects alive.
    drop(memfd);
    drop(pipe_rx);

    let mut buf = [0u8; 64];
    let (n, mut fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
    assert_eq!(&buf[..n], b"two fds");
    assert_eq!(fds.len(), 2);

    let mut pipe_rx = File::from(fds.pop().unwrap());
    let mut memfd = File::from(fds.pop().unwrap());
    memfd.seek(SeekFrom::Start(0)).unwrap();
    let mut text = String::new();
    memfd.read_to_string(&mut text).unwrap();
    assert_eq!(text, "weights live here");

    let mut pipe_tx = File::from(pipe_tx);
    pipe_tx.write_all(b"through the pipe").unwrap();
    drop(pipe_tx);
    let mut text = String::new();
    pipe_rx.read_to_string(&mut text).unwrap();
    assert_eq!(text, "through the pipe");
}

#[test]
fn fds_ride_on_the_first_byte_and_are_not_merged_across_messages() {
    let (a, b) = UnixStream::pair().unwrap();
    let first = tempfile::tempfile().unwrap();
    let second = tempfile::tempfile().unwrap();
    send_with_fds(&a, b"one", &[first.as_fd()]).unwrap();
    send_with_fds(&a, b"two", &[second.as_fd()]).unwrap();

    let mut buf = [0u8; 64];
    let (n, fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
    assert_eq!(
        &buf[..n],
        b"one",
        "the kernel stops a read at the next message with fds"
    );
    assert_eq!(fds.len(), 1);
    let (n, fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
    assert_eq!(&buf[..n], b"two");
    assert_eq!(fds.len(), 1);

    drop(a);
    let (n, fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
    assert_eq!((n, fds.len()), (0, 0), "end of stream");
}

#[test]
fn surplus_fds_are_all_closed_and_refused() {
    let (a, b) = UnixStream::pair().unwrap();
    let (pipe_rx, pipe_tx) = nix::unistd::pipe().unwrap();
    let rx = pipe_rx.as_fd();
    send_with_fds(&a, b"x", &[rx, rx, rx]).unwrap();
    drop(pipe_rx);

    let mut buf = [0u8; 8];
    match recv_with_fds(&b, &mut buf, 1) {
        Err(FdPassError::TooManyReceived { got: 3, max_fds: 1 }) => {}
        other => panic!("{other:?}"),
    }
    // Every received read end is closed: writing to the pipe now fails with EPIPE.
    let err = File::from(pipe_tx).write_all(b"y").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BrokenPipe);
}

#[test]
fn a_receiver_accepting_no_fds_closes_what_arrives() {
    let (a, b) = UnixStream::pair().unwrap();
    let (pipe_rx, pipe_tx) = nix::unistd::pipe().unwrap();
    send_with_fds(&a, b"x", &[pipe_rx.as_fd()]).unwrap();
    drop(pipe_rx);
    let mut buf = [0u8; 8];
    assert!(matches!(
        recv_with_fds(&b, &mut buf, 0),
        Err(FdPassError::TooManyReceived { got: 1, max_fds: 0 })
    ));
    let err = File::from(pipe_tx).write_all(b"y").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BrokenPipe);
}

#[test]
fn sending_to_a_closed_peer_fails_without_a_signal() {
    let (a, b) = UnixStream::pair().unwrap();
    drop(b);
    let file = tempfile::tempfile().unwrap();
    match send_with_fds(&a, b"x", &[file.as_fd()]) {
        Err(FdPassError::Sendmsg { source }) => assert_eq!(source, nix::errno::Errno::EPIPE),
        other => panic!("{other:?}"),
    }
}
