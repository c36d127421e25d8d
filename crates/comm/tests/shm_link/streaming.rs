//! Moving bytes: streaming both ways through a small ring, several links sharing one doorbell,
//! zero-copy receive, and the (ignored) bandwidth measurement.
use std::time::Instant;

use comm::transport::shm::{ShmDomain, ShmEndpoint, ShmLink};
use comm::transport::{Link, LinkKind, Readiness};

use super::{TempDir, pair, pattern, poll_fds, wait_one};

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
