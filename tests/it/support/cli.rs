//! Child processes the tests run: the `mailroom admin` CLI, example and client scripts
//! that print one JSON line, and the mailroom binary itself.

use std::time::Duration;

/// Runs `mailroom admin --server http://<addr> [--token <token>] <args>` with no token in
/// the environment; returns whether it succeeded, its stdout and its stderr.
pub async fn admin_cli(
    addr: std::net::SocketAddr,
    token: Option<&str>,
    args: &[&str],
) -> (bool, String, String) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.arg("admin").arg("--server");
    cmd.arg(format!("http://{addr}"));
    if let Some(t) = token {
        cmd.arg("--token").arg(t);
    }
    cmd.args(args).env_remove("MAILROOM_ADMIN_TOKEN");
    let out = cmd.output().await.expect("run mailroom admin");
    let stdout = String::from_utf8(out.stdout).unwrap();
    (
        out.status.success(),
        stdout,
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Runs `mailroom admin` and returns its exit code and stderr.
pub async fn admin_cli_code(
    addr: std::net::SocketAddr,
    token: Option<&str>,
    args: &[&str],
) -> (Option<i32>, String) {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.arg("admin").args(args).arg("--server");
    cmd.arg(format!("http://{addr}"));
    if let Some(t) = token {
        cmd.arg("--token").arg(t);
    }
    let out = cmd
        .env_remove("MAILROOM_ADMIN_TOKEN")
        .output()
        .await
        .expect("run mailroom admin");
    (out.status.code(), String::from_utf8(out.stderr).unwrap())
}

/// [`admin_cli`] that must succeed; returns its stdout.
pub async fn admin_cli_ok(
    addr: std::net::SocketAddr,
    token: Option<&str>,
    args: &[&str],
) -> String {
    let (ok, out, err) = admin_cli(addr, token, args).await;
    assert!(ok, "mailroom admin {args:?} failed: {err}");
    out
}

/// [`admin_cli_ok`] with `--json` first; returns the JSON it prints.
pub async fn admin_cli_json(
    addr: std::net::SocketAddr,
    token: Option<&str>,
    args: &[&str],
) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&admin_cli_ok(addr, token, &a).await).expect("--json prints JSON")
}

/// A path inside the repository.
pub fn repo_path(rel: &str) -> String {
    format!("{}/{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// Runs `program <the repository's script> args` with `envs` added, which must succeed
/// (`what` names it in the failure, `needs` says what is missing when it cannot start),
/// and parses the one JSON line it prints.
pub async fn run_json(
    program: &str,
    script: &str,
    args: &[String],
    envs: &[(&str, &str)],
    needs: &str,
    what: &str,
) -> serde_json::Value {
    let out = tokio::process::Command::new(program)
        .arg(repo_path(script))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .await
        .expect(needs);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed: {stderr}\n{stdout}");
    serde_json::from_str(stdout.trim()).expect("one JSON line")
}

/// Waits until something accepts connections on 127.0.0.1:`port` (30 s at most; `what`
/// names it in the failure).
pub async fn wait_listening(port: u16, what: &str) {
    let listening = || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    };
    super::eventually(Duration::from_secs(30), what, listening).await;
}
