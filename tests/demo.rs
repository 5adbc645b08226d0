//! The README's main job, run as a test: two processes, a verified transfer, a suppressed
//! completion that times out, and a third request served afterwards.
use std::process::Command;

#[test]
fn demo_runs_and_handles_the_fault_on_tcp_and_shared_memory() {
    for transport in ["tcp", "sm"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvlink-demo"))
            .args(["--transport", transport, "--timeout-ms", "1000"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}");
        assert!(out.status.success(), "{transport}: demo failed:\n{text}");
        assert!(
            text.contains("request 2: ") && text.contains("-> TimedOut"),
            "{text}"
        );
        assert!(
            text.contains("expected TimedOut at the 1s deadline: yes"),
            "{transport}: the faulty request did not end at its deadline:\n{text}"
        );
        assert!(text
            .contains("context side reported: CTX 1 Completed, CTX 2 TimedOut, CTX 3 Completed"));
        assert_eq!(
            text.matches("every byte verified: true").count(),
            2,
            "{text}"
        );
    }
}

/// `--transport` takes any transport setting, as the other binaries' and the C++ demo's do
/// (README, "The `transport` setting"): here tcp on the loopback device. It used to take only
/// `tcp` and `sm`, and clap refused `tcp@lo` before the demo ran.
#[test]
fn demo_takes_a_transport_setting_with_devices() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlink-demo"))
        .args(["--transport", "tcp@lo", "--timeout-ms", "1000"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{text}\n{err}");
    assert!(text.contains("kvlink demo: OK"), "{text}");
}
