//! Imports the terrain consistency model's ONNX graph with burn-onnx at build time.
//!
//! The file is `terrain_diffusion/weights/terrain_consistency_unet_difficulty100.onnx` of the
//! PyPI wheel `adaptive-terrain-diffusion==0.4.2`; `tools/fetch-terrain.sh` puts it (sha256
//! checked) at `<repo>/.terrain/`, or `OXIDIFF_TERRAIN_ONNX` names it. Without it the crate
//! builds without the model (cfg `terrain_model` unset) and its tests say how to get it;
//! `OXIDIFF_REQUIRE_TERRAIN=1` (set by `tools/test.sh`) makes a missing file a build error.
//!
//! The graph is the whole consistency function `D(x, sigma, difficulty)`: the UNet wrapped
//! in the consistency parameterisation (`c_in`, `c_skip`, `c_out`, `t = 250 ln sigma`, the
//! clip to [-1, 1]). oxidiff's `CMStochasticIterativeScheduler` applies that wrapping itself,
//! as diffusers does, so the build cuts the graph down to the network `F(c_in x, t,
//! difficulty)`: the inputs become the tensors `mul_22` (`c_in * noisy`) and `mul_27`
//! (`250 ln sigma`), the output `conv2d_195` (the last convolution), and nodes and
//! initializers no longer reachable are dropped. burn-onnx then generates a Burn module of
//! the cut graph, generic over the backend, with the weights in a `.bpk` file.

use std::path::{Path, PathBuf};

use onnx_ir::{ModelProto, ValueInfoProto};
use protobuf::Message;

const FILE: &str = "terrain_consistency_unet_difficulty100.onnx";

/// The tensors where the cut is made (names in the exported graph), and their new names.
const SAMPLE: (&str, &str) = ("mul_22", "sample");
const TIMESTEP: (&str, &str) = ("mul_27", "timestep");
const OUTPUT: (&str, &str) = ("conv2d_195", "model_output");

fn main() {
    println!("cargo::rustc-check-cfg=cfg(terrain_model)");
    println!("cargo::rerun-if-env-changed=OXIDIFF_TERRAIN_ONNX");
    println!("cargo::rerun-if-env-changed=OXIDIFF_REQUIRE_TERRAIN");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let default = manifest.join("../../.terrain").join(FILE);
    let path = std::env::var_os("OXIDIFF_TERRAIN_ONNX")
        .map(PathBuf::from)
        .unwrap_or(default);
    println!("cargo::rerun-if-changed={}", path.display());
    if !path.is_file() {
        let required = std::env::var("OXIDIFF_REQUIRE_TERRAIN").is_ok_and(|v| v == "1");
        if required {
            panic!(
                "OXIDIFF_REQUIRE_TERRAIN=1 but {} does not exist; run tools/fetch-terrain.sh \
                 (or set OXIDIFF_TERRAIN_ONNX to the file)",
                path.display()
            );
        }
        println!(
            "cargo::warning=terrain model not built: {} not found (run tools/fetch-terrain.sh)",
            path.display()
        );
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let cut = out.join("terrain_unet.onnx");
    if let Err(e) = cut_to_network(&path, &cut) {
        panic!("{}: {e}", path.display());
    }
    burn_onnx::ModelGen::new()
        .input(cut.to_str().unwrap())
        .out_dir("model/")
        .run_from_script();
    println!("cargo::rustc-cfg=terrain_model");
}

/// Writes the graph of `src` cut to the network between the consistency scalings (see the
/// top comment) to `dst`.
fn cut_to_network(src: &Path, dst: &Path) -> Result<(), String> {
    let bytes = std::fs::read(src).map_err(|e| e.to_string())?;
    let mut model = ModelProto::parse_from_bytes(&bytes).map_err(|e| e.to_string())?;
    let graph = model.graph.as_mut().ok_or("no graph")?;
    let input = |name: &str| -> Result<ValueInfoProto, String> {
        graph
            .input
            .iter()
            .find(|v| v.name == name)
            .cloned()
            .ok_or_else(|| format!("graph input `{name}` not found; is this the 0.4.2 model?"))
    };
    // `c_in * noisy` has noisy's type, `250 ln sigma` has sigma's.
    let mut sample = input("noisy")?;
    sample.name = SAMPLE.1.into();
    let mut timestep = input("sigma")?;
    timestep.name = TIMESTEP.1.into();
    let difficulty = input("difficulty")?;
    let mut output = graph.output.first().cloned().ok_or("graph has no output")?;
    output.name = OUTPUT.1.into();
    for (old, _) in [SAMPLE, TIMESTEP, OUTPUT] {
        if !graph.node.iter().any(|n| n.output.iter().any(|o| o == old)) {
            return Err(format!(
                "no node produces `{old}`; is this the 0.4.2 model?"
            ));
        }
    }

    // Keep the nodes the new output needs, stopping at the new inputs.
    let stop = [SAMPLE.0, TIMESTEP.0, "difficulty"];
    let mut needed: std::collections::HashSet<String> = [OUTPUT.0.to_string()].into();
    let mut keep = vec![false; graph.node.len()];
    for (i, node) in graph.node.iter().enumerate().rev() {
        if node.output.iter().any(|o| needed.contains(o)) {
            keep[i] = true;
            for name in &node.input {
                if !name.is_empty() && !stop.contains(&name.as_str()) {
                    needed.insert(name.clone());
                }
            }
        }
    }
    let mut i = 0;
    graph.node.retain(|_| {
        i += 1;
        keep[i - 1]
    });
    let rename = |name: &mut String| {
        for (old, new) in [SAMPLE, TIMESTEP, OUTPUT] {
            if name == old {
                *name = new.to_string();
            }
        }
    };
    for node in graph.node.iter_mut() {
        node.input.iter_mut().for_each(rename);
        node.output.iter_mut().for_each(rename);
    }
    graph.initializer.retain(|t| needed.contains(&t.name));
    graph.value_info.retain(|v| needed.contains(&v.name));
    graph.input = vec![sample, timestep, difficulty];
    graph.output = vec![output];
    let bytes = model.write_to_bytes().map_err(|e| e.to_string())?;
    std::fs::write(dst, bytes).map_err(|e| format!("{}: {e}", dst.display()))
}
