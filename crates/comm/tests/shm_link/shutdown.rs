//! The end of a link: shutdown delivers pending bytes then reports closed, wakes a sleeping
//! peer, and the death of the peer's process closes the link.
use std::time::{Duration, Instant};

use comm::transport::shm::ShmDomain;
use comm::transport::{Link, LinkError, Readiness};

use super::{TempDir, expect_closed, pair, poll_fds, wait_one};

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
