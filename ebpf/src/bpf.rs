//! The BPF side: loads `tracer.bpf.o` (built by `build.rs`), attaches its programs, owns the
//! `sandboxes` counter map and drains the `events` ring buffer on a thread.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use aya::programs::BtfTracePoint;
use aya::{Btf, Ebpf, EbpfLoader};

use crate::sys;
use crate::types::{Counters, Fault, Sink, Targets, TraceEvent, TracerError};

/// The object built from `bpf/tracer.bpf.c`.
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tracer.bpf.o"));

const EV_EXIT: u32 = 1;
const EV_SIGNAL: u32 = 2;
const EV_OOM: u32 = 3;

/// A ring-buffer record; layout of `struct event` in bpf/tracer.bpf.c.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawEvent {
    kind: u32,
    pid: u32,
    tid: u32,
    signal: i32,
    exit_code: i32,
    sender_pid: u32,
    cgroup_id: u64,
    sender_cgroup_id: u64,
    ktime_ns: u64,
}

impl RawEvent {
    fn parse(bytes: &[u8]) -> Option<RawEvent> {
        if bytes.len() < std::mem::size_of::<RawEvent>() {
            return None;
        }
        // SAFETY: the slice holds at least size_of::<RawEvent>() bytes, RawEvent is repr(C) made
        // of integers (every bit pattern valid), and read_unaligned copes with any alignment.
        Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<RawEvent>()) })
    }
}

/// BTF tracepoints (task pointers needed): program name, tracepoint.
const BTF_PROGRAMS: &[(&str, &str)] = &[
    ("on_fork", "sched_process_fork"),
    ("on_exit", "sched_process_exit"),
    ("on_signal", "signal_generate"),
    ("on_oom_victim", "mark_victim"),
];

/// Raw syscall tracepoints counting file activity (x86_64 syscall numbers in the object).
#[cfg(target_arch = "x86_64")]
const FILE_PROGRAMS: &[(&str, &str)] =
    &[("on_sys_enter", "sys_enter"), ("on_sys_exit", "sys_exit")];
/// No syscall table for this architecture in the object: no file counters.
#[cfg(not(target_arch = "x86_64"))]
const FILE_PROGRAMS: &[(&str, &str)] = &[];

/// The loaded programs and the counter map; a thread drains the ring buffer.
pub(crate) struct BpfTracer {
    /// Keeps the programs attached (dropping it detaches them).
    _ebpf: Ebpf,
    sandboxes: Mutex<BpfHashMap<MapData, u64, Counters>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl BpfTracer {
    /// Loads and attaches the programs. `host_mnt_ns`: inode number of a mount namespace
    /// whose files are not sandbox state (the agent's own; 0 for none). `sandbox_pid_level`:
    /// depth of the sandboxes' pid namespaces; tasks of a tracked cgroup in shallower ones
    /// count nothing (0: every task counts).
    pub(crate) fn start(
        targets: Targets,
        sink: Sink,
        host_mnt_ns: u64,
        sandbox_pid_level: u32,
    ) -> Result<BpfTracer, TracerError> {
        let btf = Btf::from_sys_fs().map_err(TracerError::Btf)?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .override_global("host_mnt_ns", &host_mnt_ns, true)
            .override_global("sandbox_pid_level", &sandbox_pid_level, true)
            .load(OBJECT)
            .map_err(TracerError::Load)?;
        for (name, tp) in BTF_PROGRAMS {
            let prog: &mut BtfTracePoint = program(&mut ebpf, name)?;
            prog.load(tp, &btf)
                .and_then(|()| prog.attach().map(drop))
                .map_err(|source| TracerError::Program { name, source })?;
        }
        for (name, tp) in FILE_PROGRAMS {
            let prog: &mut BtfTracePoint = program(&mut ebpf, name)?;
            prog.load(tp, &btf)
                .and_then(|()| prog.attach().map(drop))
                .map_err(|source| TracerError::Program { name, source })?;
        }
        let sandboxes = ebpf
            .take_map("sandboxes")
            .ok_or_else(|| TracerError::Missing("map sandboxes".into()))?;
        let sandboxes: BpfHashMap<MapData, u64, Counters> = BpfHashMap::try_from(sandboxes)
            .map_err(|source| TracerError::Map {
                name: "sandboxes",
                op: "open",
                source,
            })?;
        let events = ebpf
            .take_map("events")
            .ok_or_else(|| TracerError::Missing("map events".into()))?;
        let ring = RingBuf::try_from(events).map_err(|source| TracerError::Map {
            name: "events",
            op: "open",
            source,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bpf-events".into())
            .spawn(move || drain(ring, targets, sink, flag))
            .map_err(TracerError::Thread)?;
        Ok(BpfTracer {
            _ebpf: ebpf,
            sandboxes: Mutex::new(sandboxes),
            stop,
            thread: Some(thread),
        })
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BpfHashMap<MapData, u64, Counters>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn track(&self, cgroup_id: u64) -> Result<(), TracerError> {
        self.map()
            .insert(cgroup_id, Counters::default(), 0)
            .map_err(|source| TracerError::Map {
                name: "sandboxes",
                op: "insert",
                source,
            })
    }

    pub(crate) fn untrack(&self, cgroup_id: u64) {
        let _ = self.map().remove(&cgroup_id);
    }

    pub(crate) fn counters(&self, cgroup_id: u64) -> Option<Counters> {
        self.map().get(&cgroup_id, 0).ok()
    }
}

impl Drop for BpfTracer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, TracerError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| TracerError::Missing(format!("program {name}")))?
        .try_into()
        .map_err(|_| TracerError::Missing(format!("program {name} of the expected type")))
}

/// Drains the ring buffer until `stop`, turning records into faults for `sink`.
fn drain(mut ring: RingBuf<MapData>, targets: Targets, sink: Sink, stop: Arc<AtomicBool>) {
    let fd = ring.as_raw_fd();
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = [libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }];
        if let Err(e) = sys::poll(&mut pfd, 100) {
            tracing::error!(error = %e, "polling the BPF ring buffer failed; tracer stops");
            return;
        }
        while let Some(item) = ring.next() {
            let Some(ev) = RawEvent::parse(&item) else {
                continue;
            };
            drop(item);
            if let Some(fault) = classify(&ev, &targets) {
                tracing::debug!(cgroup_id = ev.cgroup_id, %fault, "sandbox fault");
                sink(TraceEvent {
                    cgroup_id: ev.cgroup_id,
                    fault,
                    observed: Instant::now(),
                });
            }
        }
    }
}

/// The fault a record stands for: every external kill and OOM victim; an exit only when it is
/// the sandbox init's.
fn classify(ev: &RawEvent, targets: &Targets) -> Option<Fault> {
    match ev.kind {
        EV_SIGNAL => Some(Fault::ExternalKill {
            pid: ev.pid as i32,
            signal: ev.signal,
            sender_pid: Some(ev.sender_pid as i32),
        }),
        EV_OOM => Some(Fault::Oom {
            pid: Some(ev.pid as i32),
        }),
        EV_EXIT => {
            let init = targets
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&ev.cgroup_id)
                .map(|t| t.init_pid)?;
            (init == ev.pid as i32).then_some(Fault::InitExited {
                pid: init,
                exit_code: (ev.signal == 0).then_some(ev.exit_code),
                signal: (ev.signal != 0).then_some(ev.signal),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_events_parse() {
        assert_eq!(std::mem::size_of::<RawEvent>(), 48);
        let mut bytes = vec![0u8; 48];
        bytes[0..4].copy_from_slice(&EV_SIGNAL.to_ne_bytes());
        bytes[4..8].copy_from_slice(&42u32.to_ne_bytes());
        bytes[12..16].copy_from_slice(&9i32.to_ne_bytes());
        bytes[20..24].copy_from_slice(&7u32.to_ne_bytes());
        let ev = RawEvent::parse(&bytes).unwrap();
        let targets: Targets = Arc::default();
        assert_eq!(
            classify(&ev, &targets),
            Some(Fault::ExternalKill {
                pid: 42,
                signal: 9,
                sender_pid: Some(7)
            })
        );
        assert!(RawEvent::parse(&bytes[..10]).is_none());
    }
}
