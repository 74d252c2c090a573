//! The CPU BLAS's thread count: rmlx sets it from the cores the process may use, or from
//! `RMLX_BLAS_THREADS`, and leaves OpenBLAS's own variables in force. Each case runs this test
//! binary again as a child (the count is set once per process) that prints `rmlx::blas_threads()`.

use std::process::Command;

const CHILD_ENV: &str = "RMLX_BLAS_TEST_CHILD";

#[test]
fn child_entry() {
    if std::env::var_os(CHILD_ENV).is_some() {
        // Use MLX once, as a program would, then report.
        let x = rmlx::Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        assert_eq!(x.matmul(&x).unwrap().to_vec::<f32>().unwrap(), vec![7.0, 10.0, 15.0, 22.0]);
        println!("BLAS_THREADS={:?}", rmlx::blas_threads());
    }
}

/// `rmlx::blas_threads()` in a child run with `env` (and under `prefix`, a command such as taskset).
fn child(prefix: &[&str], env: &[(&str, &str)]) -> Option<usize> {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match prefix.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads", "1"]).env(CHILD_ENV, "1");
    for var in ["RMLX_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find_map(|l| l.split("BLAS_THREADS=").nth(1)).map(str::trim).expect("the child's report");
    match line {
        "None" => None,
        s => Some(s.trim_start_matches("Some(").trim_end_matches(')').parse().unwrap()),
    }
}

#[test]
fn thread_count_follows_the_cores_available_unless_chosen() {
    let Some(default) = child(&[], &[]) else {
        eprintln!("MLX does not run on OpenBLAS here (reference BLAS, CUDA or Metal): nothing to check");
        return;
    };
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(default, cores, "default thread count");
    assert_eq!(child(&[], &[("RMLX_BLAS_THREADS", "1")]), Some(1));
    assert_eq!(child(&[], &[("RMLX_BLAS_THREADS", "3")]), Some(3));
    // OpenBLAS's own variable stays in force (OpenBLAS read it when it loaded).
    assert_eq!(child(&[], &[("OPENBLAS_NUM_THREADS", "1")]), Some(1));
    // A bad value is ignored with a warning: the default applies.
    assert_eq!(child(&[], &[("RMLX_BLAS_THREADS", "zero")]), Some(cores));
    // Pinned to one core (affinity), the process uses one thread.
    if Command::new("taskset").arg("--version").output().is_ok_and(|o| o.status.success()) {
        assert_eq!(child(&["taskset", "-c", "0"], &[]), Some(1));
    }
}
