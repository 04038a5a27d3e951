//! The grpo-cli binary as a user runs it.
#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn version_and_help() {
    let out = cli(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("grpo-cli {}", env!("CARGO_PKG_VERSION"))
    );
    let out = cli(&["--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("advantages"));
}

#[test]
fn advantages_prints_grpo_core_values() {
    let out = cli(&[
        "advantages",
        "--rewards",
        "1,0,0.5,0.5,nan,1",
        "--num-generations",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<f32> = String::from_utf8_lossy(&out.stdout)
        .trim()
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let want = grpo_core::group_advantages(
        &[1.0, 0.0, 0.5, 0.5, f32::NAN, 1.0],
        3,
        grpo_core::ScaleRewards::Group,
    );
    assert_eq!(got, want);
    let out = cli(&[
        "advantages",
        "--rewards",
        "1,0,-1,0",
        "--num-generations",
        "2",
        "--scale-rewards",
        "rloo",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1,-1,-1,1");
}

#[test]
fn bad_input_is_one_line_naming_the_argument() {
    for (args, needle) in [
        (
            vec!["advantages", "--rewards", "1,x", "--num-generations", "2"],
            "--rewards",
        ),
        (
            vec!["advantages", "--rewards", "1,2,3", "--num-generations", "2"],
            "--num-generations",
        ),
        (
            vec![
                "advantages",
                "--rewards",
                "1,2",
                "--num-generations",
                "2",
                "--scale-rewards",
                "grp",
            ],
            "--scale-rewards",
        ),
    ] {
        let out = cli(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{err}");
    }
}
