//! The server against `txt2img`: an OpenAI request and an A1111 request give the PNGs `txt2img`
//! writes for the same parameters and seeds (same pixels, same bytes), and concurrent requests
//! run in shared batches while each image stays the one it is alone.

mod support;

use std::sync::Arc;

use serde_json::json;
use support::{assert_same_png, txt2img, unbase64, Server};

#[test]
fn openai_and_a1111_requests_give_the_images_of_txt2img() {
    let server = Server::start(&[]);
    let prompt = "a photo of an astronaut riding a horse";

    let answer = server.post(
        "/v1/images/generations",
        &json!({
            "prompt": prompt, "n": 2, "size": "64x64", "seed": 7, "steps": 4,
            "scheduler": "Euler a", "response_format": "b64_json", "model": "ignored",
        }),
    );
    assert_eq!(answer.status, 200, "{}", answer.text);
    let data = answer.json()["data"].as_array().expect("data").clone();
    assert_eq!(data.len(), 2);
    let want = txt2img(
        &[
            "--steps",
            "4",
            "--seed",
            "7",
            "--scheduler",
            "Euler a",
            prompt,
        ],
        2,
    );
    for (i, (item, want)) in data.iter().zip(&want).enumerate() {
        assert_eq!(item["seed"], 7 + i as u64);
        let got = unbase64(item["b64_json"].as_str().expect("b64_json"));
        assert_same_png(&got, want, &format!("OpenAI image {i}"));
    }

    let answer = server.post(
        "/sdapi/v1/txt2img",
        &json!({
            "prompt": prompt, "negative_prompt": "blurry", "steps": 3, "cfg_scale": 5.0,
            "width": 64, "height": 64, "seed": 11, "sampler_name": "DPM++ 2M",
            "scheduler": "Karras", "batch_size": 2, "n_iter": 1, "restore_faces": false,
        }),
    );
    assert_eq!(answer.status, 200, "{}", answer.text);
    let body = answer.json();
    let want = txt2img(
        &[
            "--steps",
            "3",
            "--guidance",
            "5",
            "--seed",
            "11",
            "--scheduler",
            "DPM++ 2M Karras",
            "--negative-prompt",
            "blurry",
            prompt,
        ],
        2,
    );
    let images = body["images"].as_array().expect("images");
    assert_eq!(images.len(), 2);
    for (i, (image, want)) in images.iter().zip(&want).enumerate() {
        let got = unbase64(image.as_str().expect("base64"));
        assert_same_png(&got, want, &format!("A1111 image {i}"));
    }
    let info: serde_json::Value =
        serde_json::from_str(body["info"].as_str().expect("info is a JSON string")).unwrap();
    assert_eq!(info["all_seeds"], json!([11, 12]));
    assert_eq!(info["sampler_name"], "DPM++ 2M Karras");
    let infotext = info["infotexts"][1].as_str().expect("infotexts");
    assert!(
        infotext.contains("Seed: 12") && infotext.contains("Negative prompt: blurry"),
        "{infotext}"
    );
    assert_eq!(body["parameters"]["seed"], 11);
}

#[test]
fn concurrent_requests_share_batches_and_each_image_is_its_single_image() {
    let server = Arc::new(Server::start(&[
        "--max-batch",
        "4",
        "--batch-window-ms",
        "300",
    ]));
    let request = |i: u64| {
        json!({
            "prompt": format!("prompt number {i}"), "size": "64x64", "seed": 100 + i, "steps": 2,
        })
    };
    let threads: Vec<_> = (0..16)
        .map(|i| {
            let server = server.clone();
            let body = request(i);
            std::thread::spawn(move || server.post("/v1/images/generations", &body))
        })
        .collect();
    let batched: Vec<_> = threads
        .into_iter()
        .map(|t| {
            let answer = t.join().expect("client thread");
            assert_eq!(answer.status, 200, "{}", answer.text);
            unbase64(answer.json()["data"][0]["b64_json"].as_str().unwrap())
        })
        .collect();
    let shared: f64 = (2..=4)
        .map(|size| server.metric(&format!("oxidiff_batches_total{{size=\"{size}\"}}")))
        .sum();
    assert!(
        shared >= 1.0,
        "no batch held more than one image:\n{}",
        server.get("/metrics").text
    );
    assert_eq!(server.metric("oxidiff_images_total"), 16.0);
    let batches_before = server.metric("oxidiff_batches_total{size=\"1\"}");
    for (i, batched) in batched.iter().enumerate() {
        let answer = server.post("/v1/images/generations", &request(i as u64));
        let alone = unbase64(answer.json()["data"][0]["b64_json"].as_str().unwrap());
        assert_same_png(batched, &alone, &format!("request {i}, batched and alone"));
    }
    assert_eq!(
        server.metric("oxidiff_batches_total{size=\"1\"}") - batches_before,
        16.0,
        "the requests one after another ran alone"
    );
}

#[test]
fn listing_endpoints_describe_the_loaded_model() {
    let server = Server::start(&[]);
    let health = server.get("/healthz").json();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["model"], "tiny-sd1");
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tiny-sd1");
    let samplers = server.get("/sdapi/v1/samplers").json();
    let names: Vec<&str> = samplers
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    for name in ["Euler a", "Euler", "DPM++ 2M", "LMS", "Heun"] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    assert!(
        !names.contains(&"FlowMatchEulerDiscreteScheduler"),
        "{names:?}"
    );
    assert_eq!(
        server.get("/sdapi/v1/sd-models").json()[0]["model_name"],
        "tiny-sd1"
    );
    let progress = server.get("/sdapi/v1/progress").json();
    assert_eq!(progress["state"]["job_count"], 0);
    let page = server.get("/");
    assert!(page.text.contains("<title>oxidiff</title>"));
    let metrics = server.get("/metrics").text;
    assert!(
        metrics.contains("# TYPE oxidiff_queue_depth gauge"),
        "{metrics}"
    );
}
