//! `comm::partition`: a cut holds a store request until it heals or its deadline, and the
//! store answers again afterwards. A test binary of its own: a cut holds every thread of the
//! process, which would disturb tests running beside it.

use comm::partition::{cut_for, hold, remaining};
use comm::store::{Secret, StoreClient, StoreServer};
use std::time::{Duration, Instant};

#[test]
fn a_cut_holds_callers_until_it_heals_or_their_deadline() {
    let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
    let client = StoreClient::connect(server.local_addr(), &secret, 0, Duration::from_secs(5))
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    client.set("k", b"v").unwrap();
    assert!(!hold(Instant::now()), "not cut: no wait");

    cut_for(Duration::from_millis(600));
    assert!(remaining().is_some());
    // A request whose deadline comes first fails as on a silent store, naming the cut.
    let t0 = Instant::now();
    let e = client.get("k").unwrap_err().to_string();
    assert!(e.contains("cut off the network"), "{e}");
    assert!(
        t0.elapsed() >= Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
    // A caller with a later deadline waits for the heal, then talks.
    assert!(
        !hold(Instant::now() + Duration::from_secs(10)),
        "healed first"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(remaining(), None);
    assert_eq!(client.get("k").unwrap(), Some(b"v".to_vec()));
}
