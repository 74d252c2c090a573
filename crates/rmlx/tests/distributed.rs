//! MLX's ring backend between two processes on this machine: the test runs its own binary twice as
//! the two ranks (the ignored `ring_worker` test), with the environment `rmlx launch` sets
//! (`MLX_RANK`, `MLX_HOSTFILE`), and checks what each rank computed.

use rmlx::distributed::{Backend, Group};
use rmlx::{Array, Dtype};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One rank's checks, each printing `ok <what>`; run only by `two_ranks_over_the_ring`.
#[test]
#[ignore = "a rank of two_ranks_over_the_ring"]
fn ring_worker() {
    let group = Group::init(Backend::Ring, true).unwrap();
    let (rank, size) = (group.rank(), group.size());
    assert_eq!(size, 2);
    assert_eq!(rank, std::env::var("MLX_RANK").unwrap().parse::<usize>().unwrap());
    let r = rank as f32;
    let mine = Array::from_slice(&[r + 1.0, 10.0 * (r + 1.0), -r], &[3]).unwrap();

    assert_eq!(group.all_sum(&mine).unwrap().to_vec::<f32>().unwrap(), [3.0, 30.0, -1.0]);
    println!("ok all_sum");
    assert_eq!(group.all_max(&mine).unwrap().to_vec::<f32>().unwrap(), [2.0, 20.0, 0.0]);
    assert_eq!(group.all_min(&mine).unwrap().to_vec::<f32>().unwrap(), [1.0, 10.0, -1.0]);
    println!("ok all_max all_min");
    let gathered = group.all_gather(&mine.reshape(&[1, 3]).unwrap()).unwrap();
    assert_eq!(gathered.shape(), [2, 3]);
    assert_eq!(gathered.to_vec::<f32>().unwrap(), [1.0, 10.0, 0.0, 2.0, 20.0, -1.0]);
    println!("ok all_gather");
    // MLX's ring has no sum_scatter (NCCL has): an error from the evaluation, naming it.
    let rows = Array::from_slice(&[r, r + 1.0, r + 2.0, r + 3.0], &[4]).unwrap();
    let err = group.sum_scatter(&rows).and_then(|a| a.to_vec::<f32>()).unwrap_err();
    assert!(err.to_string().contains("sum_scatter not supported"), "{err}");
    assert!(group.sum_scatter(&mine).is_err(), "3 rows do not split over 2 ranks");
    println!("ok sum_scatter");

    if rank == 0 {
        let sent = group.send(&Array::from_slice(&[7i32, 8, 9], &[3]).unwrap(), 1).unwrap();
        rmlx::eval([&sent]).unwrap();
    } else {
        let got = group.recv(&[3], Dtype::Int32, 0).unwrap();
        assert_eq!(got.to_vec::<i32>().unwrap(), [7, 8, 9]);
    }
    assert!(group.send(&mine, rank).is_err(), "a send to itself");
    assert!(group.recv(&[3], Dtype::Float32, 5).is_err(), "a receive from rank 5 of 2");
    println!("ok send recv");

    // MLX's ring cannot split a group either: an error naming it.
    let err = group.split(rank as i32, None).unwrap_err();
    assert!(err.to_string().contains("split not supported"), "{err}");
    println!("ok split");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn two_ranks_over_the_ring() {
    if !Backend::Ring.is_available() {
        panic!("this MLX build has no ring backend");
    }
    let dir = std::env::temp_dir().join(format!("rmlx-ring-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hosts.json");
    // MLX's ring hostfile: one list of "ip:port" addresses per rank.
    let hosts = format!("[[\"127.0.0.1:{}\"], [\"127.0.0.1:{}\"]]", free_port(), free_port());
    std::fs::write(&hostfile, hosts).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "ring_worker", "--nocapture", "--test-threads", "1"])
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut statuses = [None, None];
    while statuses.iter().any(Option::is_none) && Instant::now() < deadline {
        for (s, c) in statuses.iter_mut().zip(&mut children) {
            if s.is_none() {
                *s = c.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (rank, (status, child)) in statuses.iter().zip(&mut children).enumerate() {
        if status.is_none() {
            let _ = child.kill();
        }
        let (mut out, mut err) = (String::new(), String::new());
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        assert!(status.is_some_and(|s| s.success()), "rank {rank}: {status:?}\n{out}\n{err}");
        for what in ["all_sum", "all_max all_min", "all_gather", "sum_scatter", "send recv", "split"] {
            assert!(out.contains(&format!("ok {what}\n")), "rank {rank} did not check {what}:\n{out}\n{err}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
