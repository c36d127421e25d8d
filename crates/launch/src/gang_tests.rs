//! Tests of [`super`]: admission, failures, restarts, aborts and elastic membership.

use super::*;
use crate::elastic::LeaseKeeper;
use comm::store::{Secret, StoreServer};

const LEASE: Duration = Duration::from_secs(2);

fn both() -> Membership {
    Membership { nodes: vec![0, 1] }
}

fn store() -> (StoreServer, StoreClient, StoreClient) {
    let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
    let c = |_| StoreClient::connect(s.local_addr(), &secret, 0, Duration::from_secs(5)).unwrap();
    let (a, b) = (c(0), c(1));
    (s, a, b)
}

/// A third client of `s`.
fn third(s: &StoreServer) -> StoreClient {
    let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    StoreClient::connect(s.local_addr(), &secret, 0, Duration::from_secs(5)).unwrap()
}

/// Nodes 0, 1 and 2 of a `--nnodes 2:3` job, through `a`, `b` and `c`.
fn elastic<'a>(
    a: &'a StoreClient,
    b: &'a StoreClient,
    c: &'a StoreClient,
) -> (Gang<'a>, Gang<'a>, Gang<'a>) {
    let range = NodeRange::new(2, 3).unwrap();
    (
        Gang::new(a, range, 0, LEASE),
        Gang::new(b, range, 1, LEASE),
        Gang::new(c, range, 2, LEASE),
    )
}

#[test]
fn admission_names_the_missing_node() {
    let (_s, a, _b) = store();
    let e = Gang::new(&a, 3, 0, LEASE)
        .admit(0, Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(e.contains("generation 0") && e.contains("[1, 2]"), "{e}");
}

#[test]
fn an_abort_reaches_every_node() {
    let (_s, a, b) = store();
    let (n0, n1) = (Gang::new(&a, 2, 0, LEASE), Gang::new(&b, 2, 1, LEASE));
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let d = n1.await_decision(0, Duration::from_secs(10)).unwrap();
            assert_eq!(d, Decision::Abort("out of restarts".into()));
        });
        n0.abort(0, &both(), "out of restarts", Duration::from_secs(10))
            .unwrap();
    });
    let e = n1
        .await_decision(7, Duration::ZERO)
        .unwrap_err()
        .to_string();
    assert!(e.contains("generation 7"), "{e}");
}

#[test]
fn a_failure_restarts_every_node_and_old_reports_are_refused() {
    let (_s, a, b) = store();
    let (n0, n1) = (Gang::new(&a, 2, 0, LEASE), Gang::new(&b, 2, 1, LEASE));
    let member = Admitted::Member(both());
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert_eq!(n1.admit(0, Duration::from_secs(10)).unwrap(), member);
            assert_eq!(n1.report_failure(0, "rank 3 died").unwrap(), "rank 3 died");
            n1.failure_seen(0);
            let old = b.try_clone().unwrap();
            let d = n1.await_decision(0, Duration::from_secs(10)).unwrap();
            assert_eq!(d, Decision::Restart(1));
            // A late completion message of generation 0 is refused by the store.
            assert!(old.set("launch/g0/done/1", b"1").is_err());
            assert_eq!(n1.admit(1, Duration::from_secs(10)).unwrap(), member);
            n1.mark_done(1).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while !n1.complete(1, &both(), Duration::ZERO).unwrap() {
                assert!(Instant::now() < deadline);
                std::thread::sleep(POLL);
            }
        });
        assert_eq!(n0.admit(0, Duration::from_secs(10)).unwrap(), member);
        let deadline = Instant::now() + Duration::from_secs(10);
        let failure = loop {
            if let Some(f) = n0.failure(0).unwrap() {
                break f;
            }
            assert!(Instant::now() < deadline);
            std::thread::sleep(POLL);
        };
        assert_eq!(n0.report_failure(0, "rank 0 too").unwrap(), failure);
        assert_eq!(n0.count_restart().unwrap(), 1);
        // Node 1 read the failure: node 0 does not wait out the bound.
        let t = Instant::now();
        n0.await_failure_seen(0, &both(), Duration::from_secs(30))
            .unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(n0.advance(0).unwrap(), 1);
        assert_eq!(n0.admit(1, Duration::from_secs(10)).unwrap(), member);
        n0.mark_done(1).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !n0.complete(1, &both(), Duration::from_secs(5)).unwrap() {
            assert!(Instant::now() < deadline);
            std::thread::sleep(POLL);
        }
    });
}

#[test]
fn an_elastic_gang_goes_on_without_a_lost_node_and_a_late_one_waits() {
    let (s, a, b) = store();
    let c = third(&s);
    let (n0, n1, n2) = elastic(&a, &b, &c);
    let three = Admitted::Member(Membership {
        nodes: vec![0, 1, 2],
    });
    std::thread::scope(|scope| {
        scope.spawn(|| assert_eq!(n1.admit(0, Duration::from_secs(10)).unwrap(), three));
        scope.spawn(|| assert_eq!(n2.admit(0, Duration::from_secs(10)).unwrap(), three));
        assert_eq!(n0.admit(0, Duration::from_secs(10)).unwrap(), three);
    });
    // Node 1 renews its lease; node 2's agent is gone after one renewal.
    let _keep = LeaseKeeper::start(&b, 1).unwrap();
    c.set(&crate::elastic::lease_key(2), b"1").unwrap();
    let m3 = Membership {
        nodes: vec![0, 1, 2],
    };
    let t0 = Instant::now();
    let lost = loop {
        if let Some(l) = n0.lost_member(&m3).unwrap() {
            break l;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "node 2 never lost");
        std::thread::sleep(POLL);
    };
    assert_eq!(lost.0, 2);
    assert!(t0.elapsed() >= LEASE - POLL, "{:?}", t0.elapsed());
    assert_eq!(n0.advance(0).unwrap(), 1);
    assert_eq!(
        n1.await_decision(0, Duration::from_secs(5)).unwrap(),
        Decision::Restart(1)
    );
    // Generation 1 starts on nodes 0 and 1 at once (node 2 is lost), long before the
    // admission deadline.
    let t1 = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert_eq!(
                n1.admit(1, Duration::from_secs(30)).unwrap(),
                Admitted::Member(both())
            )
        });
        assert_eq!(
            n0.admit(1, Duration::from_secs(30)).unwrap(),
            Admitted::Member(both())
        );
    });
    assert!(t1.elapsed() < Duration::from_secs(10), "{:?}", t1.elapsed());
    // Node 2 comes back too late: it is left out and learns of the end of the job.
    c.set_generation(c.generation().unwrap());
    assert_eq!(
        n2.admit(1, Duration::from_secs(5)).unwrap(),
        Admitted::Excluded(both())
    );
    n0.mark_done(1).unwrap();
    n1.mark_done(1).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !n1.complete(1, &both(), Duration::ZERO).unwrap() {
                assert!(Instant::now() < deadline);
                std::thread::sleep(POLL);
            }
        });
        assert!(n0.complete(1, &both(), Duration::from_secs(10)).unwrap());
    });
    assert_eq!(
        n2.await_next(1, Duration::from_secs(10)).unwrap(),
        Next::Complete
    );
    // Fewer than MIN nodes by the deadline: admission fails naming the missing ones.
    assert_eq!(n0.advance(1).unwrap(), 2);
    let e = n0
        .admit(2, Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    assert!(e.contains("generation 2") && e.contains("[1, 2]"), "{e}");
}

/// `--straggler exclude`: a node node 0 dropped is not admitted again although it registers
/// (at once: it counts as lost), it learns of the end of the job, and node 0 waits for its
/// acknowledgement while its lease lives.
#[test]
fn a_dropped_node_is_left_out_and_told_the_job_is_complete() {
    let (s, a, b) = store();
    let c = third(&s);
    let (n0, n1, n2) = elastic(&a, &b, &c);
    let _keep = LeaseKeeper::start(&c, 2).unwrap();
    n0.exclude(2);
    n0.exclude(2);
    let t = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert_eq!(
                n2.admit(0, Duration::from_secs(30)).unwrap(),
                Admitted::Excluded(both())
            );
            assert_eq!(
                n2.await_next(0, Duration::from_secs(10)).unwrap(),
                Next::Complete
            );
        });
        scope.spawn(|| {
            assert_eq!(
                n1.admit(0, Duration::from_secs(30)).unwrap(),
                Admitted::Member(both())
            )
        });
        // Node 2 registers too: wait for it, so the test shows it is left out, not late.
        a.wait_one("launch/g0/node/2", Duration::from_secs(10))
            .unwrap();
        assert_eq!(
            n0.admit(0, Duration::from_secs(30)).unwrap(),
            Admitted::Member(both())
        );
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        n0.mark_done(0).unwrap();
        n1.mark_done(0).unwrap();
        scope.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !n1.complete(0, &both(), Duration::ZERO).unwrap() {
                assert!(Instant::now() < deadline);
                std::thread::sleep(POLL);
            }
        });
        assert!(n0.complete(0, &both(), Duration::from_secs(10)).unwrap());
        // Node 2 acknowledged too (node 0 waited for it).
        assert!(a.get("launch/g0/ack/2").unwrap().is_some());
    });
}

/// A rigid job's agents renew no lease: a generation that outlives the lease timeout still
/// restarts with every node (node 0 once started their lease clocks at admission and then
/// judged them all lost, so the restart's admission timed out).
#[test]
fn a_rigid_job_restarts_with_every_node_after_the_lease_timeout() {
    let (_s, a, b) = store();
    let short = Duration::from_millis(100);
    let (n0, n1) = (Gang::new(&a, 2, 0, short), Gang::new(&b, 2, 1, short));
    let member = Admitted::Member(both());
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert_eq!(n1.admit(0, Duration::from_secs(10)).unwrap(), member);
            let d = n1.await_decision(0, Duration::from_secs(10)).unwrap();
            assert_eq!(d, Decision::Restart(1));
            assert_eq!(n1.admit(1, Duration::from_secs(10)).unwrap(), member);
        });
        assert_eq!(n0.admit(0, Duration::from_secs(10)).unwrap(), member);
        std::thread::sleep(short * 5);
        n0.report_failure(0, "rank 1 died").unwrap();
        assert_eq!(n0.count_restart().unwrap(), 1);
        assert_eq!(n0.advance(0).unwrap(), 1);
        assert_eq!(n0.admit(1, Duration::from_secs(5)).unwrap(), member);
    });
}
