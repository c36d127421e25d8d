//! `flotilla plan` through the binary: a search that finds layouts succeeds, one that finds
//! none says so and fails.
#[path = "support/cli.rs"]
mod cli;

use cli::flotilla;

#[test]
fn a_search_lists_layouts_and_succeeds() {
    let (ok, out, err) = flotilla(&["plan", "--model", "llama2-7b", "--nodes", "2", "--search"]);
    assert!(ok, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("search: "), "{out}");
    assert!(out.lines().any(|l| l.starts_with("1    tp")), "{out}");
}

#[test]
fn a_search_without_a_fitting_layout_says_why_and_fails() {
    // One sequence per step cannot be split over 8 million devices.
    let args = [
        "plan",
        "--model",
        "llama2-7b",
        "--nodes",
        "1000000",
        "--devices-per-node",
        "8",
        "--global-batch",
        "1",
    ];
    let (ok, out, err) = flotilla(&args);
    assert!(!ok, "stdout:\n{out}");
    assert!(
        out.contains("no layout fits this job on this cluster"),
        "{out}"
    );
    assert!(
        err.contains("no layout fits") && err.contains("does not divide global_batch"),
        "{err}"
    );
}
