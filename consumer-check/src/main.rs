//! Builds against lserve's public API with stable Rust. Running it opens GPU 0 if there is one.

fn main() {
    for m in lserve::gpu::KERNEL_PTX {
        println!("lserve PTX for {} ({} bytes)", m.arch, m.text().len());
    }
    match lserve::gpu::GpuContext::new(0) {
        Ok(gpu) => println!(
            "GPU: {} ({} PTX)",
            gpu.device_name().unwrap_or_default(),
            gpu.ptx().arch
        ),
        Err(e) => println!("no GPU here ({e})"),
    }
}
