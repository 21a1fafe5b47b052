//! `--device` end to end in real processes: a producer publishing device tensors into a device
//! arena and a trainer importing it by handle over the reply path, reading into device buffers.
//! Without a GPU these run against the fake CUDA driver (host memory standing in for the GPU;
//! every such test says `fake_gpu`); `scripts/gpu-check.sh` runs the same commands on a GPU.
#![cfg(feature = "cuda")]

#[path = "../../capture-arena/tests/fake_cuda/mod.rs"]
mod fake_cuda;
mod util;

use std::process::Command;

use util::EXE;

const SMALL: [&str; 12] = [
    "--samples",
    "12",
    "--min-len",
    "16",
    "--max-len",
    "512",
    "--hidden",
    "256",
    "--batch",
    "3",
    "--aux-layers",
    "3",
];

fn with_fake_gpu(c: &mut Command) -> &mut Command {
    c.env(
        "LD_LIBRARY_PATH",
        fake_cuda::dir(env!("CARGO_TARGET_TMPDIR")),
    )
}

#[test]
fn fake_gpu_demo_device_runs_producer_and_trainer_processes() {
    let text = util::stdout_of_success(
        with_fake_gpu(Command::new(EXE).arg("demo").args(SMALL)).args([
            "--arena-bytes",
            "4MiB",
            "--quiet",
            "--device",
        ]),
    );
    for needle in [
        "12 published, 12 read and verified",
        "arena completely free            ok",
        "cuda://",
        "result                           OK",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
}

#[test]
fn fake_gpu_a_device_arena_producer_dies_by_the_signal_it_is_sent() {
    // docs/commands.md: a producer stops on SIGTERM, SIGINT and SIGHUP. A device arena has no
    // shared memory to remove, and its producer once installed the handlers, returned, and left
    // the three signals ignored (it ran on until --idle-timeout).
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    for (name, number) in [("TERM", 15), ("INT", 2), ("HUP", 1)] {
        let mut producer = with_fake_gpu(&mut util::tiny_producer("1", "60"))
            .arg("--device")
            .spawn()
            .unwrap();
        let mut first = String::new();
        std::io::BufReader::new(producer.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(first.contains("cuda://"), "{first}");
        util::signal(name, producer.id());
        let mut exit = None;
        if !util::within(10, || {
            exit = producer.try_wait().unwrap();
            exit.is_some()
        }) {
            let _ = producer.kill();
            let _ = producer.wait();
            panic!("the producer ignored SIG{name} for 10 s");
        }
        assert_eq!(
            exit.and_then(|e| e.signal()),
            Some(number),
            "it dies by SIG{name}"
        );
    }
}

#[test]
fn device_flags_without_a_cuda_driver_fail_with_what_to_do() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: this machine has an NVIDIA driver; the test needs one without");
        return;
    }
    for args in [
        &[
            "produce",
            "--samples",
            "1",
            "--max-len",
            "512",
            "--arena-bytes",
            "64MiB",
            "--device",
        ][..],
        &[
            "demo",
            "--samples",
            "2",
            "--max-len",
            "512",
            "--device",
            "--quiet",
        ][..],
        &["bench", "--sizes", "1MiB", "--device"][..],
    ] {
        let out = Command::new(EXE)
            .args(args)
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded without a GPU");
        assert!(err.contains("no CUDA driver library"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

#[test]
fn fake_gpu_a_killed_device_producer_gives_stale_errors_not_its_bytes() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    let mut producer = with_fake_gpu(&mut util::tiny_producer("2", "30"))
        .arg("--device")
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(producer.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let second = lines.next().unwrap().unwrap();
    assert!(first.contains("cuda://"), "{first}");
    let mut trainer = with_fake_gpu(&mut Command::new(EXE))
        .args(["consume", "--device", "--progress", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to = trainer.stdin.take().unwrap();
    let mut from = BufReader::new(trainer.stdout.take().unwrap()).lines();
    writeln!(to, "{first}").unwrap();
    let ok = from.next().unwrap().unwrap();
    assert!(ok.contains("\"ok\":true"), "{ok}");
    // kill -9: the device memory goes with the process; the trainer's import would still map
    // it, so it must notice the producer is gone (its reply endpoint vanished with it).
    producer.kill().unwrap();
    producer.wait().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    writeln!(to, "{second}").unwrap();
    drop(to);
    let bad = from.next().unwrap().unwrap();
    assert!(bad.contains("\"ok\":false"), "{bad}");
    let rest: Vec<String> = from.map(|l| l.unwrap()).collect();
    let summary = rest.join("\n");
    assert!(summary.contains("stale session"), "{summary}");
    trainer.wait().unwrap();
}
