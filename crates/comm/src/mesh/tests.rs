//! Pure tests of the mesh arithmetic and placement (no process groups).

use super::placement::check_placement;
use super::*;

fn shape(dp: usize, pp: usize, tp: usize, ep: usize) -> MeshShape {
    MeshShape { dp, pp, tp, ep }
}

/// Every shape of up to 24 ranks with ep dividing dp.
fn grid() -> Vec<MeshShape> {
    let mut v = Vec::new();
    for dp in 1..=4 {
        for pp in 1..=3 {
            for tp in 1..=4 {
                for ep in (1..=dp).filter(|e| dp % e == 0) {
                    v.push(shape(dp, pp, tp, ep));
                }
            }
        }
    }
    v
}

/// The layouts of `s`: identity and reversed stage order.
fn layouts(s: MeshShape) -> Vec<MeshLayout> {
    let n = s.world().unwrap();
    let rev: Vec<usize> = (0..s.pp).rev().collect();
    vec![
        MeshLayout::new(s, n).unwrap(),
        MeshLayout::with_stage_order(s, n, rev).unwrap(),
    ]
}

#[test]
fn coords_and_rank_of_round_trip_over_a_grid_of_shapes() {
    for s in grid() {
        for l in layouts(s) {
            let mut seen = std::collections::HashSet::new();
            for r in 0..l.world() {
                let c = l.coords(r).unwrap();
                assert!(
                    c.dp < s.dp && c.pp < s.pp && c.tp < s.tp && c.ep < s.ep,
                    "{s} {c:?}"
                );
                assert_eq!(c.ep, c.dp % s.ep);
                assert_eq!(l.rank_of(c).unwrap(), r, "{s} order {:?}", l.stage_order());
                assert!(seen.insert(c));
            }
            assert!(l.coords(l.world()).is_err());
        }
    }
}

#[test]
fn groups_partition_the_ranks_and_match_coordinates() {
    for s in grid() {
        for l in layouts(s) {
            for axis in Axis::ALL {
                let groups = l.groups(axis);
                let size = s.size(axis);
                assert_eq!(groups.len(), l.world() / size, "{s} {axis}");
                let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
                all.sort_unstable();
                assert_eq!(all, (0..l.world()).collect::<Vec<_>>(), "{s} {axis}");
                for g in &groups {
                    assert_eq!(g.len(), size);
                    for (i, &r) in g.iter().enumerate() {
                        // Same group from every member, and position = coordinate on the axis.
                        assert_eq!(&l.axis_ranks(r, axis).unwrap(), g);
                        let c = l.coords(r).unwrap();
                        let c0 = l.coords(g[0]).unwrap();
                        let (pos, same) = match axis {
                            Axis::Tp => (c.tp, (c.dp, c.pp) == (c0.dp, c0.pp)),
                            Axis::Dp => (c.dp, (c.tp, c.pp) == (c0.tp, c0.pp)),
                            Axis::Pp => (c.pp, (c.tp, c.dp) == (c0.tp, c0.dp)),
                            Axis::Ep => (
                                c.ep,
                                (c.tp, c.pp, c.dp / s.ep) == (c0.tp, c0.pp, c0.dp / s.ep),
                            ),
                        };
                        assert_eq!(pos, i, "{s} {axis} {g:?}");
                        assert!(same, "{s} {axis} {g:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn rank_order_is_tp_then_dp_then_pp() {
    let l = MeshLayout::new(shape(2, 2, 2, 2), 8).unwrap();
    assert_eq!(
        l.groups(Axis::Tp),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        l.groups(Axis::Dp),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        l.groups(Axis::Pp),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(l.groups(Axis::Ep), l.groups(Axis::Dp));
    assert_eq!(
        l.coords(5).unwrap(),
        MeshCoord {
            dp: 0,
            pp: 1,
            tp: 1,
            ep: 0
        }
    );
    // ep 2 of dp 4: replicas {0,1} and {2,3} form the EP groups.
    let l = MeshLayout::new(shape(4, 1, 1, 2), 4).unwrap();
    assert_eq!(l.groups(Axis::Ep), vec![vec![0, 1], vec![2, 3]]);
}

#[test]
fn bad_shapes_name_the_fields_and_the_equation() {
    let e = shape(2, 2, 3, 1).validate(8).unwrap_err().to_string();
    assert!(e.contains("dp 2 x pp 2 x tp 3 = 12 != world 8"), "{e}");
    let e = shape(0, 1, 0, 1).validate(8).unwrap_err().to_string();
    assert!(e.contains("dp, tp must be at least 1"), "{e}");
    let e = shape(4, 1, 2, 3).validate(8).unwrap_err().to_string();
    assert!(e.contains("ep 3 must divide dp 4"), "{e}");
    let e = shape(usize::MAX, 2, 1, 1)
        .validate(8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("overflows"), "{e}");
    assert!(shape(2, 2, 2, 2).validate(8).is_ok());
    let s = MeshShape::new(2, 1, 1);
    let e = MeshLayout::with_stage_order(s, 2, vec![0, 1]).unwrap_err();
    assert!(e.to_string().contains("has 2 entries, pp is 1"), "{e}");
    let e = MeshLayout::with_stage_order(shape(1, 2, 1, 1), 2, vec![1, 1]).unwrap_err();
    assert!(e.to_string().contains("not a permutation"), "{e}");
    let l = MeshLayout::new(s, 2).unwrap();
    let c = MeshCoord {
        dp: 5,
        pp: 0,
        tp: 0,
        ep: 0,
    };
    assert!(l.rank_of(c).is_err());
    assert!(l.axis_ranks(2, Axis::Dp).is_err());
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|h| format!("node{h}")).collect()
}

#[test]
fn tp_inside_a_host_passes_tp_across_hosts_is_refused_unless_forced() {
    let hosts = [0, 0, 0, 0, 1, 1, 1, 1];
    let ok = MeshLayout::plan(shape(2, 1, 4, 1), &hosts, &names(2), false).unwrap();
    assert!(ok.warnings.is_empty(), "{:?}", ok.warnings);

    let e = MeshLayout::plan(shape(1, 1, 8, 1), &hosts, &names(2), false).unwrap_err();
    assert!(matches!(e, CommError::Config(_)), "{e:?}");
    let e = e.to_string();
    for want in [
        "TP group 0 (ranks [0, 1, 2, 3, 4, 5, 6, 7]) spans 2 hosts",
        "host 0 'node0' has ranks [0, 1, 2, 3]",
        "host 1 'node1' has ranks [4, 5, 6, 7]",
        "4 times per layer per micro-batch",
        "tp <= 4",
        "force",
    ] {
        assert!(e.contains(want), "missing '{want}' in: {e}");
    }

    let forced = MeshLayout::plan(shape(1, 1, 8, 1), &hosts, &names(2), true).unwrap();
    assert_eq!(forced.warnings.len(), 1);
    assert!(
        forced.warnings[0].starts_with("forced: TP group 0"),
        "{:?}",
        forced.warnings
    );

    // Hosts interleaved rank by rank: every TP pair spans both; messages stay short.
    let e = MeshLayout::plan(shape(4, 1, 2, 1), &[0, 1, 0, 1, 0, 1, 0, 1], &[], false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("and 1 more TP groups (4 of 4 TP groups span hosts)"),
        "{e}"
    );
    assert!(e.contains("host 1 has ranks [1]"), "{e}");
}

#[test]
fn ep_across_hosts_is_only_a_warning() {
    // dp 4 = 2 hosts x 2 replicas; ep 4 spans both hosts, ep 2 does not.
    let hosts = [0, 0, 1, 1];
    let p = MeshLayout::plan(shape(4, 1, 1, 4), &hosts, &[], false).unwrap();
    assert_eq!(p.warnings.len(), 1);
    assert!(p.warnings[0].contains("EP group 0 (ranks [0, 1, 2, 3]) spans 2 hosts"));
    let p = MeshLayout::plan(shape(4, 1, 1, 2), &hosts, &[], false).unwrap();
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
}

#[test]
fn stages_are_ordered_to_minimise_cross_host_hops() {
    // tp 2, pp 4, hosts interleaved by slab: A B A B. In slab order each pipeline crosses 3
    // times; stages A A B B cross once.
    let s = shape(1, 4, 2, 1);
    let hosts = [0, 0, 1, 1, 0, 0, 1, 1];
    let id = MeshLayout::new(s, 8).unwrap();
    assert_eq!(cross_host_hops(&id, &hosts).unwrap(), 2 * 3);
    let order = order_stages(s, &hosts).unwrap();
    assert_eq!(order, vec![0, 2, 1, 3]);
    let plan = MeshLayout::plan(s, &hosts, &[], false).unwrap();
    assert_eq!(plan.layout.stage_order(), &[0, 2, 1, 3]);
    assert_eq!(cross_host_hops(&plan.layout, &hosts).unwrap(), 2);
    assert_eq!(
        plan.layout.groups(Axis::Pp),
        vec![vec![0, 4, 2, 6], vec![1, 5, 3, 7]]
    );
    // Stage 1 runs on slab 2 (ranks 4, 5).
    assert_eq!(plan.layout.coords(4).unwrap().pp, 1);

    // Host-contiguous: identity kept.
    let hosts = [0, 0, 0, 0, 1, 1, 1, 1];
    assert_eq!(order_stages(s, &hosts).unwrap(), vec![0, 1, 2, 3]);

    // Three hosts C A B A C B: the best path groups equal hosts (2 hops per pipeline).
    let s = shape(1, 6, 1, 1);
    let hosts = [2, 0, 1, 0, 2, 1];
    let id = MeshLayout::new(s, 6).unwrap();
    assert_eq!(cross_host_hops(&id, &hosts).unwrap(), 5);
    let l = MeshLayout::with_stage_order(s, 6, order_stages(s, &hosts).unwrap()).unwrap();
    assert_eq!(cross_host_hops(&l, &hosts).unwrap(), 2);

    // Above the exact limit the greedy order still groups hosts: 16 slabs on hosts 0 1 0 1 ...
    let s = shape(1, 16, 1, 1);
    let hosts: Vec<usize> = (0..16).map(|r| r % 2).collect();
    let l = MeshLayout::with_stage_order(s, 16, order_stages(s, &hosts).unwrap()).unwrap();
    assert_eq!(cross_host_hops(&l, &hosts).unwrap(), 1);

    assert!(order_stages(s, &hosts[..8]).is_err());
    assert!(check_placement(&l, &hosts[..8], &[], false).is_err());
}
