//! Unit tests of [`super`]: survivors meet at the next live endpoint, the new store is fenced
//! above the lost generation, a returning node finds it, and a waiting node is seen.

use super::*;
use crate::elastic::{LeaseKeeper, Membership, NodeRange};
use crate::gang::Admitted;
use comm::CommError;

const LEASE: Duration = Duration::from_secs(2);

fn secret() -> Secret {
    Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap()
}

/// `n` loopback endpoints on ports free a moment ago.
fn endpoints(n: usize) -> Vec<SocketAddr> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter().map(|l| l.local_addr().unwrap()).collect()
}

fn start(list: &[SocketAddr], node: usize) -> (Stores, StoreClient) {
    let at = Endpoints {
        list: list.to_vec(),
        node,
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(2),
        takeover_wait: Duration::from_secs(5),
    };
    Stores::start(&at, &secret()).unwrap()
}

fn range() -> NodeRange {
    NodeRange::new(2, 3).unwrap()
}

#[test]
fn survivors_meet_at_the_next_endpoint_fenced_above_the_lost_generation() {
    let list = endpoints(3);
    let (s0, c0) = start(&list, 0);
    let (s1, c1) = start(&list, 1);
    let (s2, c2) = start(&list, 2);
    assert_eq!(
        (s1.leader_at_start(), s2.leader_at_start(), c2.addr()),
        (0, 0, list[0])
    );
    assert!(s0.replicated());
    let (g1, g2) = (
        Gang::new(&c1, range(), 1, LEASE),
        Gang::new(&c2, range(), 2, LEASE),
    );
    c0.bump_generation(0).unwrap();
    for c in [&c1, &c2] {
        c.set_generation(1);
    }
    // Node 0 dies with its store.
    drop((s0, c0));
    let (a1, a2) = std::thread::scope(|scope| {
        let t2 = scope.spawn(|| {
            (s2.take_over(&c2, &g2, 1, 0, 3, Instant::now()))
                .unwrap()
                .unwrap()
        });
        // Node 1 notices later than node 2: node 2 waits for it rather than taking over.
        std::thread::sleep(Duration::from_millis(300));
        let a1 = (s1.take_over(&c1, &g1, 1, 0, 3, Instant::now()))
            .unwrap()
            .unwrap();
        (a1, t2.join().unwrap())
    });
    let want = Active {
        addr: list[1],
        generation: 2,
        leader: 1,
    };
    assert_eq!((a1.to, a2.to), (want, want));
    assert!(
        a1.line.contains("this node now hosts the job's store")
            && a2.line.contains("following node 1")
            && a2
                .line
                .contains(&format!("the store at {} is lost", list[0])),
        "{a1:?} {a2:?}"
    );
    assert!(g1.leads() && !g2.leads() && g2.leader() == 1);
    assert_eq!((c1.addr(), c2.addr(), c2.stamp()), (list[1], list[1], 2));
    assert_eq!(c2.get("launch/restarts").unwrap(), Some(b"1".to_vec()));
    // Anything stamped with a generation of the lost store is refused.
    let old = StoreClient::connect(list[1], &secret(), 1, Duration::from_secs(5)).unwrap();
    assert!(matches!(
        old.set("launch/g1/failed", b"late"),
        Err(CommError::StaleGeneration { got: 1, current: 2 })
    ));

    // Node 0 comes back: it finds the job at node 1's store, not its own fresh one.
    let (s0, c0) = start(&list, 0);
    assert_eq!(
        (s0.leader_at_start(), c0.addr(), c0.stamp()),
        (1, list[1], 2)
    );
}

#[test]
fn a_dead_endpoint_is_passed_over_and_restarts_are_bounded() {
    let list = endpoints(3);
    let (s0, _c0) = start(&list, 0);
    let (s2, c2) = start(&list, 2);
    let g2 = Gang::new(&c2, range(), 2, LEASE);
    drop(s0);
    // Node 1 never started: node 2 is next.
    let e = (s2.take_over(&c2, &g2, 0, 2, 2, Instant::now()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("was lost") && e.contains("restarts exhausted: 2 of --max-restarts 2"),
        "{e}"
    );
    let a = (s2.take_over(&c2, &g2, 0, 1, 2, Instant::now()))
        .unwrap()
        .unwrap()
        .to;
    assert_eq!((a.addr, a.generation, a.leader), (list[2], 1, 2));
    assert!(g2.leads());
}

#[test]
fn a_single_endpoint_has_no_failover() {
    let list = endpoints(1);
    let (s0, c0) = start(&list, 0);
    let g0 = Gang::new(&c0, 1, 0, LEASE);
    assert!(!s0.replicated());
    assert_eq!(
        s0.take_over(&c0, &g0, 0, 0, 5, Instant::now()).unwrap(),
        None
    );
    // No leader key: a single-endpoint store is as it was.
    assert_eq!(c0.get(LEADER_KEY).unwrap(), None);
}

#[test]
fn a_node_registering_late_is_waiting_until_the_job_is_at_max() {
    let list = endpoints(3);
    let (_s1, c1) = start(&list[1..], 0);
    let c0 = c1.try_clone().unwrap();
    let c2 = c1.try_clone().unwrap();
    // Node 1 leads generation 0 on nodes [1, 2] (node 0 was lost).
    let leader = Gang::new(&c1, range(), 1, LEASE);
    leader.set_leader(1);
    leader.mark_lost(0);
    let n2 = Gang::new(&c2, range(), 2, LEASE);
    n2.set_leader(1);
    let _lease2 = LeaseKeeper::start(&c2, 2).unwrap();
    let m = std::thread::scope(|scope| {
        let t = scope.spawn(|| n2.admit(0, Duration::from_secs(10)).unwrap());
        let a = leader.admit(0, Duration::from_secs(10)).unwrap();
        assert_eq!(t.join().unwrap(), a);
        match a {
            Admitted::Member(m) => m,
            other => panic!("{other:?}"),
        }
    });
    assert_eq!(m.nodes, vec![1, 2]);
    assert_eq!(leader.waiting_node(0, &m).unwrap(), None);
    // Node 0 comes back: it registers after the member list, and waits.
    let n0 = Gang::new(&c0, range(), 0, LEASE);
    n0.set_leader(1);
    let _lease0 = LeaseKeeper::start(&c0, 0).unwrap();
    assert_eq!(
        n0.admit(0, Duration::from_secs(10)).unwrap(),
        Admitted::Excluded(m.clone())
    );
    assert_eq!(leader.waiting_node(0, &m).unwrap(), Some(0));
    let what = growth(0, 0, m.len(), 3);
    assert!(is_growth(&what) && !is_growth("node 0 lost"), "{what}");
    // At MAX nobody is waited for; an excluded straggler never is.
    let full = Membership {
        nodes: vec![0, 1, 2],
    };
    assert_eq!(leader.waiting_node(0, &full).unwrap(), None);
    leader.exclude(0);
    assert_eq!(leader.waiting_node(0, &m).unwrap(), None);
}

#[test]
fn a_follower_waiting_for_a_decision_takes_over_when_the_store_goes() {
    let list = endpoints(2);
    let (s0, c0) = start(&list, 0);
    let (s1, c1) = start(&list, 1);
    let g1 = Gang::new(&c1, range(), 1, LEASE);
    // Other outcomes pass through untouched.
    let kept = s1.unless_lost(Ok(7), &c1, &g1, 0, 0, 3).unwrap();
    assert_eq!(kept, Ok(7));
    let other = s1.unless_lost::<()>(Err(LaunchError::NoDecision(LEASE, 0)), &c1, &g1, 0, 0, 3);
    assert!(matches!(other, Err(LaunchError::NoDecision(..))));
    // Node 0 dies while node 1 waits for its decision after generation 0 failed.
    let decided = std::thread::scope(|scope| {
        let t = scope.spawn(|| g1.await_decision(0, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(300));
        drop((s0, c0));
        t.join().unwrap()
    });
    assert!(
        matches!(decided, Err(LaunchError::Store(CommError::Io { .. }))),
        "{decided:?}"
    );
    let t = s1
        .unless_lost(decided, &c1, &g1, 0, 0, 3)
        .unwrap()
        .unwrap_err();
    assert_eq!((t.to.addr, t.to.generation, t.to.leader), (list[1], 1, 1));
    assert!(g1.leads());
}

#[test]
fn a_straggler_dropped_before_the_failover_stays_out_after_it() {
    let list = endpoints(3);
    let (s0, c0) = start(&list, 0);
    let (s1, c1) = start(&list, 1);
    let (g0, g1) = (
        Gang::new(&c0, range(), 0, LEASE),
        Gang::new(&c1, range(), 1, LEASE),
    );
    g0.exclude(2);
    let _lease1 = LeaseKeeper::start(&c1, 1).unwrap();
    std::thread::scope(|scope| {
        let t = scope.spawn(|| g1.admit(0, Duration::from_secs(10)).unwrap());
        let m = g0.admit(0, Duration::from_secs(10)).unwrap();
        assert_eq!(m, Admitted::Member(Membership { nodes: vec![0, 1] }));
        assert_eq!(t.join().unwrap(), m);
    });
    // Node 1 took the list at admission; node 0 dies; node 1's store keeps node 2 out.
    assert_eq!(g1.excluded(), vec![2]);
    drop(g0);
    drop((s0, c0));
    let t = (s1.take_over(&c1, &g1, 0, 0, 3, Instant::now()))
        .unwrap()
        .unwrap();
    assert_eq!(t.to.leader, 1);
    assert_eq!(c1.get(EXCLUDED_KEY).unwrap(), Some(b"2".to_vec()));
}
