//! Hostile lengths must not make the reader allocate what they claim.
//!
//! A counting global allocator records the largest single allocation; this binary holds one
//! test so that no other test allocates concurrently.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use belayer_ipc::{read_frame, FrameError, Header, Kind, Request, DEFAULT_MAX_FRAME};

struct LargestAllocation;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// GlobalAlloc contract holds exactly as it does for `System`; the atomic update allocates nothing.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller upholds `alloc`'s contract (non-zero size layout), forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by `System.alloc`/`realloc` above with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated by `System` with `layout`; the caller upholds the
        // `new_size` requirements, forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

const MIB: usize = 1 << 20;

/// Runs `f` and returns the largest single allocation it made.
fn largest_during(f: impl FnOnce()) -> usize {
    LARGEST.store(0, Ordering::Relaxed);
    f();
    LARGEST.load(Ordering::Relaxed)
}

fn frame_around(payload: &[u8]) -> Vec<u8> {
    let header = Header {
        kind: Kind::Request,
        len: payload.len() as u32,
        crc: crc32fast::hash(payload),
    };
    let mut frame = header.to_bytes().to_vec();
    frame.extend_from_slice(payload);
    frame
}

#[test]
fn claimed_lengths_cost_nothing_until_the_bytes_arrive() {
    // A header claiming 3 GiB under a 4 GiB limit, followed by 100 bytes and the end of the
    // stream: truncated, and the buffer only grew with what arrived.
    let header = Header {
        kind: Kind::Request,
        len: 3 << 30,
        crc: 0,
    };
    let mut stream = header.to_bytes().to_vec();
    stream.extend_from_slice(&[0u8; 100]);
    let largest = largest_during(|| {
        let result = read_frame::<Request, _>(&mut stream.as_slice(), u32::MAX);
        assert!(
            matches!(result, Err(FrameError::Truncated { got: 100, .. })),
            "{result:?}"
        );
    });
    assert!(largest < MIB, "largest allocation {largest} bytes");

    // Over the maximum: refused from the header alone.
    let header = Header {
        kind: Kind::Request,
        len: u32::MAX,
        crc: 0,
    };
    let largest = largest_during(|| {
        let result = read_frame::<Request, _>(&mut &header.to_bytes()[..], DEFAULT_MAX_FRAME);
        assert!(
            matches!(result, Err(FrameError::TooLarge { .. })),
            "{result:?}"
        );
    });
    assert!(largest < MIB, "largest allocation {largest} bytes");

    // A CRC-valid payload whose string claims 1 GiB: bincode's byte limit refuses it.
    let mut payload = vec![1, 3]; // id 1, Request::RemoveImage
    payload.push(253); // varint marker: u64 follows
    payload.extend_from_slice(&(1u64 << 30).to_le_bytes());
    let frame = frame_around(&payload);
    let largest = largest_during(|| {
        let result = read_frame::<Request, _>(&mut frame.as_slice(), DEFAULT_MAX_FRAME);
        assert!(
            matches!(result, Err(FrameError::Decode { .. })),
            "{result:?}"
        );
    });
    assert!(largest < MIB, "largest allocation {largest} bytes");

    // A CRC-valid payload whose byte vector (checkpoint context) claims 1 GiB.
    let mut payload = vec![1, 9, 1, b'a', 0]; // id 1, Checkpoint { id: "a", prefix: 0, context
    payload.push(253);
    payload.extend_from_slice(&(1u64 << 30).to_le_bytes());
    let frame = frame_around(&payload);
    let largest = largest_during(|| {
        let result = read_frame::<Request, _>(&mut frame.as_slice(), DEFAULT_MAX_FRAME);
        assert!(
            matches!(result, Err(FrameError::Decode { .. })),
            "{result:?}"
        );
    });
    assert!(largest <= 2 * MIB, "largest allocation {largest} bytes");
}
