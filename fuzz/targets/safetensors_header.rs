//! A safetensors file from a stranger: our header check never panics, and whatever it accepts
//! the safetensors crate accepts too (it is the stricter gate in front of it), and loads.

use oxidiff_models::safetensors_check::check_header;
use safetensors::SafeTensors;

/// One input: returns normally or panics (a finding).
pub fn run(data: &[u8]) {
    if check_header(data).is_ok() {
        let parsed = SafeTensors::deserialize(data);
        assert!(
            parsed.is_ok(),
            "our check accepted what safetensors refuses: {parsed:?}"
        );
        let st = parsed.unwrap();
        for (_, view) in st.tensors() {
            std::hint::black_box(view.data().len());
        }
    }
}
