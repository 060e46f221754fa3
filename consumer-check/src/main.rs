//! Builds against lserve's public API with stable Rust. Running it opens GPU 0 if there is one.

fn main() {
    println!("lserve PTX for {} ({} bytes)", lserve::gpu::PTX_ARCH, lserve::gpu::PTX.len());
    match lserve::gpu::GpuContext::new(0) {
        Ok(gpu) => println!("GPU: {}", gpu.device_name().unwrap_or_default()),
        Err(e) => println!("no GPU here ({e})"),
    }
}
