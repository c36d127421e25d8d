//! Device meshes over real in-process groups: per-axis groups that reduce what they should, and
//! placement refusing a TP group across two (emulated) hosts unless forced.

use comm::group::{GroupConfig, ProcessGroup};
use comm::local::LocalRendezvous;
use comm::mesh::{Axis, DeviceMesh, MeshShape};
use comm::{CommError, ReduceOp};
use std::time::Duration;

/// Runs `f` on `size` ranks (threads) of a group `world` whose rank `r` claims host
/// `host_of[r]` (distinct host ids are how tests emulate hosts on one machine).
fn run_on_hosts<R: Send + 'static>(
    host_of: &[usize],
    f: impl Fn(ProcessGroup) -> comm::Result<R> + Send + Sync + Clone + 'static,
) -> Vec<comm::Result<R>> {
    let local = LocalRendezvous::start().unwrap();
    let size = host_of.len();
    let handles: Vec<_> = host_of
        .iter()
        .enumerate()
        .map(|(rank, &host)| {
            let (rdv, f) = (local.rdv.clone(), f.clone());
            std::thread::spawn(move || {
                let cfg = GroupConfig {
                    host_id: Some(format!("mesh-test-host{host}")),
                    timeout: Duration::from_secs(30),
                    connect_timeout: Duration::from_secs(30),
                    calibrate: false,
                    ..GroupConfig::default()
                };
                ProcessGroup::new(&rdv, "world", rank, size, cfg).and_then(f)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Sum over `g` of each member's global rank.
fn sum_of_ranks(g: &ProcessGroup, rank: usize) -> comm::Result<i64> {
    let mut v = vec![rank as i64; 3];
    g.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v[2])
}

#[test]
fn mesh_2x2x2_on_two_hosts_reduces_along_every_axis() {
    let hosts = [0, 0, 0, 0, 1, 1, 1, 1];
    let res = run_on_hosts(&hosts, |world| {
        let shape = MeshShape {
            dp: 2,
            pp: 2,
            tp: 2,
            ep: 2,
        };
        let mesh = DeviceMesh::new(&world, shape, false)?;
        let r = world.rank();
        let mut out = Vec::new();
        for axis in Axis::ALL {
            let g = mesh.group(axis);
            let members = mesh.layout().axis_ranks(r, axis)?;
            assert_eq!(g.size(), members.len(), "rank {r} {axis}");
            assert_eq!(members[g.rank()], r, "rank {r} {axis}");
            out.push((members, sum_of_ranks(g, r)?));
        }
        assert!(mesh.warnings().is_empty(), "{:?}", mesh.warnings());
        Ok((mesh.coord(), out))
    });
    for (r, res) in res.into_iter().enumerate() {
        let (coord, out) = res.unwrap();
        assert_eq!((coord.tp, coord.dp, coord.pp), (r % 2, (r / 2) % 2, r / 4));
        let want: [&[usize]; 4] = [
            &[r & !1, r | 1], // tp: consecutive pair
            &[r & !2, r | 2], // dp: stride 2
            &[r & !4, r | 4], // pp: stride 4, across the two hosts
            &[r & !2, r | 2], // ep = dp here (ep 2 of dp 2)
        ];
        for (axis, ((members, sum), want)) in Axis::ALL.iter().zip(out.iter().zip(want)) {
            assert_eq!(members, want, "rank {r} {axis}");
            assert_eq!(*sum, want.iter().sum::<usize>() as i64, "rank {r} {axis}");
        }
    }
}

#[test]
fn tp_group_across_two_hosts_is_refused_and_runs_when_forced() {
    let hosts = [0, 0, 1, 1];
    let res = run_on_hosts(&hosts, |world| {
        let shape = MeshShape::new(1, 1, 4);
        let refused = match DeviceMesh::new(&world, shape, false) {
            Err(e @ CommError::Config(_)) => e.to_string(),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a TP group across two hosts must be refused"),
        };
        // The world is still usable, and a forced mesh runs.
        let mesh = DeviceMesh::new(&world, shape, true)?;
        let sum = sum_of_ranks(mesh.tp(), world.rank())?;
        Ok((refused, mesh.warnings().to_vec(), sum))
    });
    for res in res {
        let (refused, warnings, sum) = res.unwrap();
        for want in [
            "TP group 0 (ranks [0, 1, 2, 3]) spans 2 hosts",
            "'mesh-test-host0' has ranks [0, 1]",
            "'mesh-test-host1' has ranks [2, 3]",
            "4 times per layer per micro-batch",
            "force",
        ] {
            assert!(refused.contains(want), "missing '{want}' in: {refused}");
        }
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with("forced: TP group 0"),
            "{warnings:?}"
        );
        assert_eq!(sum, 6);
    }
}

#[test]
fn ranks_passing_different_shapes_fail_together_instead_of_hanging() {
    let res = run_on_hosts(&[0, 0], |world| {
        let shape = if world.rank() == 0 {
            MeshShape::new(2, 1, 1)
        } else {
            MeshShape::new(1, 1, 2)
        };
        Ok(DeviceMesh::new(&world, shape, false)
            .err()
            .map(|e| e.to_string()))
    });
    for res in res {
        let e = res.unwrap().expect("must be refused");
        assert!(e.contains("passed a different shape"), "{e}");
    }
}
