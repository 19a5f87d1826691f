//! Compiles the gRPC API with the vendored protoc, so a fresh machine needs no protoc install.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("mailroom_descriptor.bin"))
        .compile_with_config(
            config,
            &[
                "proto/mailroom/v1/outbox.proto",
                "proto/mailroom/v1/admin.proto",
                "proto/mailroom/v1/inbox.proto",
                "proto/mailroom/v1/handler.proto",
            ],
            &["proto"],
        )?;
    // tonic-prost-build does not make cargo rebuild on a .proto change by itself.
    println!("cargo:rerun-if-changed=proto");
    // sqlx::migrate! embeds the migration files: a new file must rebuild the crate.
    println!("cargo:rerun-if-changed=migrations");
    Ok(())
}
