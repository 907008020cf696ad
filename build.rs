fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    Ok(())
}
