//! The server in compiled mode on XLA's CPU plugin: every batch size is compiled while it
//! starts, so requests of the default size and step count, alone or batched, compile nothing
//! more (the counts in `/metrics` stay where the warm-up left them).

mod support;

use std::sync::Arc;

use serde_json::json;
use support::Server;

#[test]
fn compiled_mode_warms_every_batch_size_and_requests_compile_nothing() {
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        eprintln!("OXIDIFF_SKIP_PJRT_TESTS=1: left out");
        return;
    }
    let server = Arc::new(Server::start(&[
        "--device",
        "xla:cpu",
        "--compile",
        "--max-batch",
        "2",
        "--batch-window-ms",
        "500",
    ]));
    let programs = server.metric("oxidiff_compiled_programs");
    let compiles =
        server.metric("oxidiff_xla_compiles") + server.metric("oxidiff_disk_cache_loads");
    assert!(
        programs >= 2.0,
        "the warm-up built {programs} programs for 2 batch sizes"
    );
    // The default step count: another one may meet scheduler steps of another structure
    // (small programs, compiled on that first request).
    let request = |seed: u64| json!({"prompt": "a fox", "seed": seed});
    let pair: Vec<_> = (0..2)
        .map(|i| {
            let server = server.clone();
            std::thread::spawn(move || server.post("/v1/images/generations", &request(i)))
        })
        .collect();
    for answer in pair {
        let answer = answer.join().unwrap();
        assert_eq!(answer.status, 200, "{}", answer.text);
    }
    let alone = server.post("/v1/images/generations", &request(9));
    assert_eq!(alone.status, 200, "{}", alone.text);
    assert!(server.metric("oxidiff_batches_total{size=\"2\"}") >= 1.0);
    assert_eq!(server.metric("oxidiff_compiled_programs"), programs);
    assert_eq!(
        server.metric("oxidiff_xla_compiles") + server.metric("oxidiff_disk_cache_loads"),
        compiles,
        "a request compiled a program after the warm-up"
    );
}
