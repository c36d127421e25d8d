//! Tests of the shared-memory transport ([`comm::transport::shm`]), with threads as ranks.
//!
//! Every test works in its own directory under `/dev/shm`, removed when it ends.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use comm::transport::shm::{ShmDomain, ShmEndpoint, ShmLink};
use comm::transport::{Link, LinkError, LinkKind, Readiness};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A fresh directory under /dev/shm, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!(
            "/dev/shm/flotilla-shm-test-{}-{tag}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).expect("create temp dir under /dev/shm");
        TempDir(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Domains for ranks 0 and 1 and the link pair between them.
fn pair(dir: &Path, ring_bytes: usize) -> (ShmDomain, ShmDomain, ShmLink, ShmLink) {
    let d0 = ShmDomain::create(dir, "pair", 0, &[1], ring_bytes).expect("create rank 0");
    let d1 = ShmDomain::create(dir, "pair", 1, &[0], ring_bytes).expect("create rank 1");
    let l01 = d0.connect(d1.endpoint()).expect("connect 0->1");
    let l10 = d1.connect(d0.endpoint()).expect("connect 1->0");
    (d0, d1, l01, l10)
}

/// Deterministic pseudo-random bytes (xorshift64), different per seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Sleeps on a stalled link like the progress engine does (5 s limit).
fn wait_one(link: &mut ShmLink, want_send: bool, want_recv: bool) {
    if let Readiness::Fd { fd, events } = link.prepare_wait(want_send, want_recv) {
        poll_fds(&[(fd, events)]);
        link.after_wait();
    }
}

fn poll_fds(fds: &[(i32, i16)]) {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    // SAFETY: pfds is a live array of valid pollfd structs.
    let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 5000) };
    assert!(r > 0, "poll timed out or failed (lost wake-up?): {r}");
}

/// One link's job in [`drive`]: bytes to send and bytes expected back.
struct Job {
    link: ShmLink,
    send: Vec<u8>,
    sent: usize,
    recv: Vec<u8>,
    got: usize,
}

impl Job {
    fn new(link: ShmLink, send: Vec<u8>, recv_len: usize) -> Job {
        Job {
            link,
            send,
            sent: 0,
            recv: vec![0; recv_len],
            got: 0,
        }
    }

    fn done(&self) -> bool {
        self.sent == self.send.len() && self.got == self.recv.len()
    }
}

/// A minimal progress engine: try every link (with odd chunk sizes) until nothing moves, then
/// arm every stalled link and sleep in one poll on their fds.
fn drive(jobs: &mut [Job]) {
    const SEND_CHUNKS: [usize; 5] = [1, 63, 4097, 65536, 1 << 20];
    const RECV_CHUNKS: [usize; 4] = [7, 4097, 100_000, 1 << 20];
    let (mut si, mut ri) = (0, 0);
    while !jobs.iter().all(Job::done) {
        let mut moved = false;
        for job in jobs.iter_mut() {
            if job.sent < job.send.len() {
                let end = job
                    .send
                    .len()
                    .min(job.sent + SEND_CHUNKS[si % SEND_CHUNKS.len()]);
                si += 1;
                let n = job
                    .link
                    .try_send(&job.send[job.sent..end])
                    .expect("try_send");
                job.sent += n;
                moved |= n > 0;
            }
            if job.got < job.recv.len() {
                let end = job
                    .recv
                    .len()
                    .min(job.got + RECV_CHUNKS[ri % RECV_CHUNKS.len()]);
                ri += 1;
                let n = job
                    .link
                    .try_recv_into(&mut job.recv[job.got..end])
                    .expect("try_recv_into");
                job.got += n;
                moved |= n > 0;
            }
        }
        if moved {
            continue;
        }
        let mut fds = Vec::new();
        let mut ready = false;
        for job in jobs.iter_mut().filter(|j| !j.done()) {
            let (ws, wr) = (job.sent < job.send.len(), job.got < job.recv.len());
            match job.link.prepare_wait(ws, wr) {
                Readiness::Ready => ready = true,
                Readiness::Fd { fd, events } => fds.push((fd, events)),
            }
        }
        if !ready {
            poll_fds(&fds);
        }
        for job in jobs.iter_mut() {
            job.link.after_wait();
        }
    }
}

fn expect_closed<T: std::fmt::Debug>(r: Result<T, LinkError>) -> String {
    match r {
        Err(LinkError::Closed(msg)) => msg,
        other => panic!("expected LinkError::Closed, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// (1) Streaming both ways through a small ring
// ---------------------------------------------------------------------------------------------

#[test]
fn shm_streams_both_directions_through_small_ring() {
    let dir = TempDir::new("stream");
    let (_d0, _d1, l01, l10) = pair(dir.path(), 4096);
    assert_eq!(l01.kind(), LinkKind::Shm);
    let len = (64 << 20) + 1 + 63 + 4097;
    let (a, b) = (pattern(1, len), pattern(2, len));
    let (a2, b2) = (a.clone(), b.clone());
    let t0 = Instant::now();
    let h0 = std::thread::spawn(move || {
        let mut jobs = [Job::new(l01, a2, len)];
        drive(&mut jobs);
        std::mem::take(&mut jobs[0].recv)
    });
    let h1 = std::thread::spawn(move || {
        let mut jobs = [Job::new(l10, b2, len)];
        drive(&mut jobs);
        std::mem::take(&mut jobs[0].recv)
    });
    let got0 = h0.join().expect("rank 0");
    let got1 = h1.join().expect("rank 1");
    eprintln!("2 x {len} bytes through a 4 KiB ring in {:?}", t0.elapsed());
    assert!(got0 == b, "rank 0 received corrupted bytes");
    assert!(got1 == a, "rank 1 received corrupted bytes");
}

/// Rank 0 talks to ranks 1 and 2 at once, sleeping on its one shared doorbell.
#[test]
fn shm_shared_doorbell_serves_several_links() {
    let dir = TempDir::new("three");
    let ring = 64 << 10;
    let d: Vec<ShmDomain> = (0..3)
        .map(|r| {
            let peers: Vec<usize> = (0..3).filter(|&p| p != r).collect();
            ShmDomain::create(dir.path(), "tri", r, &peers, ring).expect("create")
        })
        .collect();
    let ep: Vec<ShmEndpoint> = d.iter().map(|x| x.endpoint().clone()).collect();
    let len = 8 << 20;
    let msg = |from: usize, to: usize| pattern((10 * from + to) as u64, len);
    let mut handles = Vec::new();
    for (r, dom) in d.iter().enumerate() {
        let peers: Vec<usize> = (0..3).filter(|&p| p != r).collect();
        let jobs: Vec<Job> = peers
            .iter()
            .map(|&p| Job::new(dom.connect(&ep[p]).expect("connect"), msg(r, p), len))
            .collect();
        handles.push(std::thread::spawn(move || {
            let mut jobs = jobs;
            drive(&mut jobs);
            jobs.into_iter()
                .map(|j| (j.link.peer_rank(), j.recv))
                .collect::<Vec<_>>()
        }));
    }
    for d in &d {
        d.unlink_files().expect("unlink");
    }
    for (r, h) in handles.into_iter().enumerate() {
        for (p, got) in h.join().expect("rank thread") {
            assert!(
                got == msg(p, r),
                "rank {r} got corrupted bytes from rank {p}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (2) Zero-copy receive
// ---------------------------------------------------------------------------------------------

#[test]
fn shm_recv_with_hands_out_ring_pieces() {
    let dir = TempDir::new("with");
    let (_d0, _d1, mut tx, mut rx) = pair(dir.path(), 4096);
    let data = pattern(3, 9000);

    // Unwrapped: one piece.
    assert_eq!(tx.try_send(&data[..3000]).unwrap(), 3000);
    let mut pieces: Vec<Vec<u8>> = Vec::new();
    let n = rx
        .try_recv_with(usize::MAX, &mut |p: &[u8]| {
            pieces.push(p.to_vec());
            p.len()
        })
        .unwrap();
    assert_eq!(n, 3000);
    assert_eq!(pieces, vec![data[..3000].to_vec()]);

    // Wrapped at 4096: two pieces that concatenate to the sent bytes.
    assert_eq!(tx.try_send(&data[3000..6000]).unwrap(), 3000);
    pieces.clear();
    let n = rx
        .try_recv_with(usize::MAX, &mut |p: &[u8]| {
            pieces.push(p.to_vec());
            p.len()
        })
        .unwrap();
    assert_eq!(n, 3000);
    assert_eq!(
        pieces.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![1096, 1904]
    );
    assert_eq!(pieces.concat(), &data[3000..6000]);

    // A sink that takes only part of a piece sees the rest next time; later pieces wait.
    assert_eq!(tx.try_send(&data[6000..9000]).unwrap(), 3000);
    let mut calls = 0;
    let n = rx
        .try_recv_with(usize::MAX, &mut |p: &[u8]| {
            calls += 1;
            assert_eq!(p, &data[6000..6000 + p.len()]);
            100
        })
        .unwrap();
    assert_eq!((n, calls), (100, 1));
    // `max` limits what is offered.
    let n = rx.try_recv_with(10, &mut |p: &[u8]| {
        assert_eq!(p, &data[6100..6110]);
        p.len()
    });
    assert_eq!(n.unwrap(), 10);
    // A sink claiming more than it was given is clamped to the piece.
    let mut rest = Vec::new();
    let n = rx
        .try_recv_with(usize::MAX, &mut |p: &[u8]| {
            rest.extend_from_slice(p);
            usize::MAX
        })
        .unwrap();
    assert_eq!(n, 2890);
    assert_eq!(rest, &data[6110..9000]);
    // Nothing left: zero, not an error.
    assert_eq!(
        rx.try_recv_with(usize::MAX, &mut |_: &[u8]| unreachable!())
            .unwrap(),
        0
    );
}

// ---------------------------------------------------------------------------------------------
// (3) Bad endpoints and arguments
// ---------------------------------------------------------------------------------------------

fn connect_err(d: &ShmDomain, ep: &ShmEndpoint) -> std::io::Error {
    d.connect(ep).expect_err("connect must fail")
}

#[test]
fn shm_bad_endpoints_are_errors() {
    use std::io::ErrorKind::{AlreadyExists, InvalidData, InvalidInput, NotFound};
    let dir = TempDir::new("bad");
    let p = dir.path();
    let d0 = ShmDomain::create(p, "bad", 0, &[1, 2], 4096).unwrap();
    let d1 = ShmDomain::create(p, "bad", 1, &[0], 4096).unwrap();
    let good = d1.endpoint().clone();

    // The endpoint survives the store's JSON round trip.
    let json = serde_json::to_string(&good).unwrap();
    assert_eq!(serde_json::from_str::<ShmEndpoint>(&json).unwrap(), good);

    let mut ep = good.clone();
    ep.segment = p.join("missing");
    assert_eq!(connect_err(&d0, &ep).kind(), NotFound);
    let mut ep = good.clone();
    ep.doorbell = p.join("missing.bell");
    assert_eq!(connect_err(&d0, &ep).kind(), NotFound);
    let mut ep = good.clone();
    ep.doorbell = good.segment.clone(); // a regular file is no doorbell
    assert_eq!(connect_err(&d0, &ep).kind(), InvalidData);
    let mut ep = good.clone();
    ep.peers = vec![5];
    assert_eq!(
        connect_err(&d0, &ep).kind(),
        InvalidData,
        "my rank not in its list"
    );
    let mut ep = good.clone();
    ep.peers = vec![0, 0];
    assert_eq!(
        connect_err(&d0, &ep).kind(),
        InvalidData,
        "list disagrees with file size"
    );
    let mut ep = good.clone();
    ep.nonce ^= 1;
    assert_eq!(connect_err(&d0, &ep).kind(), InvalidData, "stale nonce");
    for bytes in [0, 100, 8192, usize::MAX] {
        let mut ep = good.clone();
        ep.ring_bytes = bytes;
        assert_eq!(
            connect_err(&d0, &ep).kind(),
            InvalidData,
            "ring_bytes {bytes}"
        );
    }
    let mut ep = good.clone();
    ep.rank = 0;
    assert_eq!(
        connect_err(&d0, &ep).kind(),
        InvalidInput,
        "rank 0 is not its own peer"
    );
    let mut ep = good.clone();
    ep.rank = 2; // a local peer of rank 0, but the segment belongs to rank 1
    assert_eq!(connect_err(&d0, &ep).kind(), InvalidData);
    let mut ep = good.clone();
    ep.pid = i32::MAX as u32 - 7; // no such process
    assert!(d0.connect(&ep).is_err());

    // Emptied file, then wrong magic.
    let d3 = ShmDomain::create(p, "magic", 1, &[0], 4096).unwrap();
    std::fs::write(&d3.endpoint().segment, []).ok(); // truncates to zero: size mismatch
    let d0b = ShmDomain::create(p, "magic", 0, &[1], 4096).unwrap();
    assert_eq!(
        connect_err(&d0b, d3.endpoint()).kind(),
        InvalidData,
        "truncated to zero"
    );
    let d4 = ShmDomain::create(p, "magic2", 1, &[0], 4096).unwrap();
    let d0c = ShmDomain::create(p, "magic2", 0, &[1], 4096).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&d4.endpoint().segment)
            .unwrap();
        f.write_all_at(b"NOTMAGIC", 0).unwrap();
    }
    assert_eq!(
        connect_err(&d0c, d4.endpoint()).kind(),
        InvalidData,
        "wrong magic"
    );

    // Truncated file.
    let d5 = ShmDomain::create(p, "trunc", 1, &[0], 4096).unwrap();
    let d0d = ShmDomain::create(p, "trunc", 0, &[1], 4096).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&d5.endpoint().segment)
        .unwrap();
    f.set_len(1000).unwrap();
    assert_eq!(
        connect_err(&d0d, d5.endpoint()).kind(),
        InvalidData,
        "truncated"
    );

    // Good endpoint connects once; a second link on the same SPSC ring is refused.
    let _link = d0.connect(&good).expect("good endpoint");
    assert_eq!(connect_err(&d0, &good).kind(), AlreadyExists);

    // Bad creation arguments; names are never reused.
    assert_eq!(
        ShmDomain::create(p, "x", 0, &[1], 100).unwrap_err().kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "x", 0, &[0], 4096).unwrap_err().kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "x", 0, &[1, 1], 4096)
            .unwrap_err()
            .kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "a/b", 0, &[1], 4096)
            .unwrap_err()
            .kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "bad", 1, &[0], 4096)
            .unwrap_err()
            .kind(),
        AlreadyExists
    );
}

#[test]
fn shm_unlink_keeps_links_working() {
    let dir = TempDir::new("unlink");
    let (d0, d1, mut l01, mut l10) = pair(dir.path(), 4096);
    d0.unlink_files().unwrap();
    d1.unlink_files().unwrap();
    d1.unlink_files().unwrap(); // idempotent
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "files left behind"
    );
    assert_eq!(l01.try_send(b"hello").unwrap(), 5);
    let mut buf = [0u8; 8];
    assert_eq!(l10.try_recv_into(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    // Dropping the domains first must not invalidate the links either.
    drop((d0, d1));
    assert_eq!(l10.try_send(b"back").unwrap(), 4);
    assert_eq!(l01.try_recv_into(&mut buf).unwrap(), 4);
    assert_eq!(&buf[..4], b"back");
}

#[test]
fn shm_domain_drop_removes_files() {
    let dir = TempDir::new("drop");
    let d = ShmDomain::create(dir.path(), "gone", 3, &[0, 1, 2], 4096).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    drop(d);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

// ---------------------------------------------------------------------------------------------
// (4) Shutdown
// ---------------------------------------------------------------------------------------------

#[test]
fn shm_shutdown_delivers_pending_bytes_then_closed() {
    let dir = TempDir::new("shut");
    let (_d0, _d1, mut a, mut b) = pair(dir.path(), 4096);
    assert_eq!(a.try_send(b"last words").unwrap(), 10);
    a.shutdown();
    expect_closed(a.try_send(b"x"));
    assert_eq!(b.prepare_wait(true, true), Readiness::Ready);
    b.after_wait();
    let mut buf = [0u8; 64];
    assert_eq!(b.try_recv_into(&mut buf).unwrap(), 10);
    assert_eq!(&buf[..10], b"last words");
    let msg = expect_closed(b.try_recv_into(&mut buf));
    assert!(msg.contains("rank 0"), "{msg}");
    expect_closed(b.try_recv_with(10, &mut |p: &[u8]| p.len()));
    expect_closed(b.try_send(b"y"));
}

#[test]
fn shm_shutdown_wakes_a_sleeping_peer() {
    let dir = TempDir::new("wake");
    let (_d0, _d1, a, mut b) = pair(dir.path(), 4096);
    let t0 = Instant::now();
    let sleeper = std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        loop {
            match b.try_recv_into(&mut buf) {
                Ok(0) => wait_one(&mut b, false, true),
                Ok(n) => panic!("unexpected {n} bytes"),
                Err(e) => return e,
            }
        }
    });
    std::thread::sleep(Duration::from_millis(50));
    drop(a); // drop shuts the link down
    let err = sleeper.join().expect("sleeper");
    assert!(matches!(err, LinkError::Closed(_)), "{err:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}

// ---------------------------------------------------------------------------------------------
// (5) Peer process death
// ---------------------------------------------------------------------------------------------

#[test]
fn shm_dead_peer_process_is_closed() {
    let dir = TempDir::new("death");
    let d0 = ShmDomain::create(dir.path(), "death", 0, &[1], 4096).unwrap();
    let d1 = ShmDomain::create(dir.path(), "death", 1, &[0], 4096).unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let mut ep = d1.endpoint().clone();
    ep.pid = child.id(); // pretend rank 1 lives in the child
    let mut link = d0.connect(&ep).expect("connect");
    let death = link.death_fd().expect("a pidfd for another process");
    let mut buf = [0u8; 8];
    assert_eq!(link.try_recv_into(&mut buf).unwrap(), 0);

    child.kill().unwrap();
    child.wait().unwrap();
    poll_fds(&[(death, libc::POLLIN)]);
    let msg = expect_closed(link.try_recv_into(&mut buf));
    assert!(msg.contains("exited"), "{msg}");
    assert_eq!(link.prepare_wait(false, true), Readiness::Ready);
    // A same-process peer has no pidfd.
    let same = d1.connect(d0.endpoint()).unwrap();
    assert!(same.death_fd().is_none());
}

// ---------------------------------------------------------------------------------------------
// Bandwidth, not a correctness check (`cargo test -p flotilla-comm -- --ignored shm_bandwidth`)
// ---------------------------------------------------------------------------------------------

#[test]
#[ignore]
fn shm_bandwidth_one_direction() {
    let dir = TempDir::new("bw");
    let ring = comm::transport::shm::DEFAULT_RING_BYTES;
    let (_d0, _d1, mut tx, mut rx) = pair(dir.path(), ring);
    let total: usize = 4 << 30;
    let chunk = vec![7u8; 1 << 20];
    let t0 = Instant::now();
    let sender = std::thread::spawn(move || {
        let mut sent = 0;
        while sent < total {
            let n = tx
                .try_send(&chunk[..chunk.len().min(total - sent)])
                .unwrap();
            sent += n;
            if n == 0 {
                wait_one(&mut tx, true, false);
            }
        }
        tx
    });
    let mut dst = vec![0u8; 1 << 20];
    let mut got = 0;
    while got < total {
        let n = rx.try_recv_into(&mut dst).unwrap();
        got += n;
        if n == 0 {
            wait_one(&mut rx, false, true);
        }
    }
    let _tx = sender.join().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "{} GiB in {secs:.2} s: {:.2} GB/s",
        total >> 30,
        total as f64 / secs / 1e9
    );
}
