//! The end-of-run split of each rank's communication waits, over a real group: three ranks,
//! where one rank's slow compute at a step shows up as the others' wait for slower ranks.
use comm::group::GroupConfig;
use comm::local::run_threads;
use train::peer_wait::gather_split;

#[test]
fn three_ranks_split_their_waits_into_exposed_and_waiting_for_the_slowest() {
    // Step 1: rank 2 computed 0.2 s longer, so ranks 0 and 1 waited for it; step 2: rank 0.
    let waits = [[0.01, 0.21, 0.02], [0.02, 0.22, 0.12], [0.03, 0.01, 0.11]];
    let out = run_threads(3, GroupConfig::for_training().unwrap(), move |g| {
        let own = waits[g.rank()];
        gather_split(&g, &own).map_err(|e| comm::CommError::InvalidArgument(e.to_string()))
    })
    .unwrap();
    let exposed = 0.01 + 0.01 + 0.02;
    let peer = [0.0 + 0.20 + 0.0, 0.01 + 0.21 + 0.10, 0.02 + 0.0 + 0.09];
    for (rank, r) in out.into_iter().enumerate() {
        let s = r.unwrap();
        assert!((s.exposed_s - exposed).abs() < 1e-12, "rank {rank}: {s:?}");
        assert!(
            (s.peer_wait_s - peer[rank]).abs() < 1e-12,
            "rank {rank}: {s:?}"
        );
    }
}
