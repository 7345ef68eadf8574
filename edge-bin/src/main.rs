//! The `waygate` binary: a thin shell over the edge library (see `lib.rs`).

use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Parser, Subcommand};

/// waygate, an edge gateway for online games.
#[derive(Debug, Parser)]
#[command(name = "waygate", version, about)]
struct Cli {
    /// Log lines as text or JSON (RUST_LOG filters them; debug events of sessions outside
    /// `session.trace_sample_rate` are dropped).
    #[arg(long, global = true, value_enum, default_value_t = waygate::logging::LogFormat::Text)]
    log_format: waygate::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run an edge: every listener, sessions, routing, backend links, admin HTTP. Without a
    /// config file the embedded defaults apply (loopback ports, generated dev certificate,
    /// the demo route table, in-memory stores).
    Run {
        /// Edge configuration (TOML; see examples/edge.toml).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// Overrides `edge_id`.
        #[arg(long)]
        edge_id: Option<String>,
        /// Overrides `tls.dev_ca_out`: where to write the generated development CA.
        #[arg(long)]
        dev_ca_out: Option<std::path::PathBuf>,
        /// Bind every listener and the admin server on port 0 (any free port); the bound
        /// addresses are printed as a JSON line starting with `{"event":"ready"`.
        #[arg(long)]
        ephemeral_ports: bool,
        /// etcd endpoints, comma-separated (`http://10.0.0.1:2379,...`): route table, edge
        /// registration and load reports from etcd (`cluster.etcd_endpoints`).
        #[arg(long, value_delimiter = ',')]
        etcd: Vec<String>,
        /// Redis URL (`redis://host:port/db`): ownership, warm snapshots and presence shared
        /// by every edge (`cluster.redis_url`).
        #[arg(long, conflicts_with = "redis_cluster")]
        redis: Option<String>,
        /// Redis Cluster seed nodes, comma-separated (`redis://10.0.0.3:7000,...`), instead
        /// of `--redis` (`cluster.redis_cluster`).
        #[arg(long, value_delimiter = ',')]
        redis_cluster: Vec<String>,
        /// Redis Sentinel URLs, comma-separated (`redis://10.0.0.5:26379,...`), instead of
        /// `--redis`: the edge asks them for the primary (`cluster.redis_sentinels`).
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["redis", "redis_cluster"])]
        redis_sentinels: Vec<String>,
        /// The master name the sentinels monitor (`cluster.redis_sentinel_master`).
        #[arg(long, requires = "redis_sentinels")]
        redis_sentinel_master: Option<String>,
        /// Accept the public development key although a listener is beyond loopback
        /// (`auth.insecure_dev_key`). Only on a closed test network.
        #[arg(long)]
        insecure_dev_key: bool,
    },
    /// Ask a running edge to drain (`POST /drain` on its admin server): every client is sent
    /// MIGRATE to another edge, new ones are refused, and the edge exits when empty or at
    /// the drain deadline. For systemd's ExecStop and Kubernetes' preStop.
    Drain {
        /// The edge's admin address.
        #[arg(long, default_value = "127.0.0.1:9100")]
        admin: SocketAddr,
        /// The admin token file (`admin.token_file`), when the edge has one.
        #[arg(long)]
        token_file: Option<std::path::PathBuf>,
    },
    /// Print a new random auth key as an `[[auth.keys]]` entry for the edge configuration
    /// (and for the login service that mints tokens with it).
    Keygen {
        /// The key id (tokens name it; use a new id for each rotation).
        #[arg(long, default_value_t = 2)]
        id: u32,
    },
    /// Mint a development auth token (base64url) with the configured (default: dev) key.
    Token {
        /// The player id.
        #[arg(long)]
        player: String,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
        /// Issuer claim.
        #[arg(long, default_value = "waygate-dev")]
        issuer: String,
        /// Audience (extension 0x02), for an edge with `auth.audiences`.
        #[arg(long)]
        audience: Option<String>,
        /// Edge configuration whose first auth key signs the token.
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// Mint a connect token (format version 2) with a fresh session key: prints the
        /// token, then the session key (base64url), one per line. KCP clients seal their
        /// sessions with the key (PROTOCOL.md §8.9).
        #[arg(long)]
        connect: bool,
    },
    /// Run the demo game backend alone (player and room services).
    Backend {
        /// Address to listen on for edge links.
        #[arg(long, default_value = "127.0.0.1:7601")]
        addr: SocketAddr,
        /// Instance id (must match the route table).
        #[arg(long, default_value = "b1")]
        id: String,
        /// Route epoch this backend knows: forwards with an older epoch are refused with
        /// `stale_epoch` (R5).
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        /// etcd endpoints, comma-separated: register this instance under a lease for each of
        /// `--services` and report its load (sessions, messages/s) for the least-loaded
        /// policy (R10). Without them nothing is registered.
        #[arg(long, value_delimiter = ',')]
        etcd: Vec<String>,
        /// The etcd key prefix (the edges' `cluster.etcd_prefix`).
        #[arg(long, default_value = "/waygate")]
        etcd_prefix: String,
        #[command(flatten)]
        etcd_access: EtcdAccessArgs,
        /// Services this instance serves (the demo game: player and room).
        #[arg(long, value_delimiter = ',', default_value = "player,room")]
        services: Vec<String>,
        /// The address edges reach it at (default: the bound address).
        #[arg(long)]
        advertise: Option<String>,
        /// A file whose first line is the link secret shared with the edges (at least 16
        /// bytes; PROTOCOL.md §9.3); `WAYGATE_LINK_SECRET` takes precedence. Required to
        /// listen beyond loopback.
        #[arg(long)]
        link_secret_file: Option<std::path::PathBuf>,
        /// Listen beyond loopback without a link secret (anything that reaches the port can
        /// act as an edge). Only on a closed network.
        #[arg(long)]
        insecure_open_links: bool,
        /// Mutual TLS on links (with --tls-cert and --tls-key): the PEM CA edges'
        /// certificates must chain to (PROTOCOL.md §9.3).
        #[arg(long, requires_all = ["tls_cert", "tls_key"])]
        tls_ca: Option<std::path::PathBuf>,
        /// This backend's PEM certificate chain for link TLS.
        #[arg(long, requires = "tls_ca")]
        tls_cert: Option<std::path::PathBuf>,
        /// This backend's PEM private key for link TLS.
        #[arg(long, requires = "tls_ca")]
        tls_key: Option<std::path::PathBuf>,
    },
    /// For a login service: answer `GET /edge` with the least-loaded enabled edge under its
    /// cap, from the edges' registrations in etcd (503 + Retry-After when none qualifies).
    Login {
        /// etcd endpoints, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        etcd: Vec<String>,
        /// The etcd key prefix (the edges' `cluster.etcd_prefix`).
        #[arg(long, default_value = "/waygate")]
        etcd_prefix: String,
        #[command(flatten)]
        etcd_access: EtcdAccessArgs,
        /// Address to serve on.
        #[arg(long, default_value = "127.0.0.1:9200")]
        addr: SocketAddr,
    },
    /// The main job for a newcomer: an edge, 3 demo backends and simulated clients on every
    /// transport, through a reconnect wave, a second-login kick and a backend drain. Exits
    /// non-zero if any message was lost or duplicated.
    Demo {
        /// Simulated clients.
        #[arg(long, default_value_t = 300)]
        clients: usize,
        /// How long clients send, e.g. `20s`, `1m`.
        #[arg(long, default_value = "20s", value_parser = parse_duration)]
        duration: std::time::Duration,
        /// Print the final report as JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Run N edge processes sharing a Redis (needs redis-server on the PATH); edge 0 is
        /// killed with SIGKILL midway and its clients resume on the others.
        #[arg(long, default_value_t = 1)]
        edges: usize,
        /// Guild channels the clients are spread over (each client joins `world` and one;
        /// with --edges N, rounded up to a multiple of N so each guild's members start on
        /// one edge).
        #[arg(long, default_value_t = 5)]
        guilds: usize,
        /// How often each client sends an echo (chats ride on every tenth), e.g. `200ms`.
        #[arg(long, default_value = "200ms", value_parser = parse_duration)]
        interval: std::time::Duration,
        /// One chat in N goes to `world`, the others to the client's guild (world
        /// deliveries grow with the clients squared: raise it for big runs).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
        world_every: u64,
    },
    /// Print the client protocol version and the close-code table.
    Protocol,
    /// Load generator and benchmark driver: edge vs direct echo vs HAProxy, interleaved,
    /// with medians and ratios (BENCHMARKS.md).
    Bench(Box<waygate::bench::BenchArgs>),
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: f64 = num.parse().map_err(|_| format!("invalid duration `{s}`"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        _ => return Err(format!("invalid duration unit in `{s}` (ms, s, m)")),
    };
    Ok(std::time::Duration::from_secs_f64(secs))
}

fn load_config(path: Option<&std::path::Path>) -> Result<waygate_edge::config::EdgeConfig, String> {
    match path {
        Some(p) => waygate_edge::config::EdgeConfig::load(p).map_err(|e| e.to_string()),
        None => Ok(waygate_edge::config::EdgeConfig::default()),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The demo prints its own progress; its edges log warnings only (RUST_LOG overrides).
    let default = if matches!(cli.command, Command::Demo { .. }) {
        // The demo stops its backends while links are up: that is not worth a warning.
        "warn,waygate_edge::link=error"
    } else {
        "info"
    };
    waygate::logging::init(default, cli.log_format, std::io::stderr);
    if let Command::Bench(args) = &cli.command {
        waygate::bench::pin_driver(args);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("waygate: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<(), String> = runtime.block_on(async move {
        match cli.command {
            Command::Run {
                config,
                edge_id,
                dev_ca_out,
                ephemeral_ports,
                etcd,
                redis,
                redis_cluster,
                redis_sentinels,
                redis_sentinel_master,
                insecure_dev_key,
            } => {
                let mut config = match config.as_deref() {
                    Some(p) => waygate_edge::config::EdgeConfig::load_unvalidated(p)
                        .map_err(|e| e.to_string())?,
                    None => waygate_edge::config::EdgeConfig::default(),
                };
                config.auth.insecure_dev_key |= insecure_dev_key;
                if let Some(id) = edge_id {
                    config.edge_id = id;
                }
                if let Some(p) = dev_ca_out {
                    config.tls.dev_ca_out = Some(p);
                }
                if ephemeral_ports {
                    config.use_ephemeral_ports();
                }
                if !etcd.is_empty() {
                    config.cluster.etcd_endpoints = etcd;
                }
                if let Some(url) = redis {
                    config.cluster.redis_url = url;
                }
                if !redis_cluster.is_empty() {
                    config.cluster.redis_cluster = redis_cluster;
                }
                if !redis_sentinels.is_empty() {
                    config.cluster.redis_sentinels = redis_sentinels;
                }
                if let Some(name) = redis_sentinel_master {
                    config.cluster.redis_sentinel_master = name;
                }
                config.validate().map_err(|e| e.to_string())?;
                let edge = waygate_edge::edge::Edge::start(config)
                    .await
                    .map_err(|e| format!("edge failed to start: {e}"))?;
                let listeners: std::collections::BTreeMap<String, String> = edge
                    .addrs
                    .iter()
                    .map(|(k, a)| (k.as_str().to_string(), a.to_string()))
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({
                        "event": "ready",
                        "listeners": listeners,
                        "admin": edge.admin_addr.map(|a| a.to_string()),
                        "edge_id": edge.edge_id(),
                    })
                );
                tokio::select! {
                    r = tokio::signal::ctrl_c() => r.map_err(|e| e.to_string())?,
                    () = async {
                        loop {
                            if edge.is_draining() {
                                edge.drained().await;
                                return;
                            }
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        }
                    } => tracing::info!("drained; exiting"),
                }
                Ok(())
            }
            Command::Drain { admin, token_file } => {
                let token = match token_file {
                    Some(p) => Some(
                        std::fs::read_to_string(&p)
                            .map_err(|e| format!("{}: {e}", p.display()))?
                            .lines()
                            .next()
                            .unwrap_or("")
                            .trim()
                            .to_owned(),
                    ),
                    None => std::env::var("WAYGATE_ADMIN_TOKEN").ok(),
                };
                let (status, body) = admin_post(admin, "/drain", token.as_deref()).await?;
                println!("{body}");
                if status == 200 {
                    Ok(())
                } else {
                    Err(format!("drain refused: HTTP {status}"))
                }
            }
            Command::Keygen { id } => {
                let mut secret = [0u8; 32];
                rand::fill(&mut secret);
                let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
                println!("[[auth.keys]]\nid = {id}\nsecret = \"{hex}\"");
                Ok(())
            }
            Command::Token {
                player,
                ttl,
                issuer,
                audience,
                config,
                connect,
            } => {
                let config = load_config(config.as_deref())?;
                let keys = waygate_edge::auth::configured_keys(&config.auth)?;
                let key = keys.first().ok_or("no auth key configured")?;
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                let claims = waygate_session::auth::TokenClaims {
                    player_id: player,
                    issuer,
                    issued_at: now,
                    expires_at: now + ttl,
                    extensions: audience
                        .map(|a| {
                            vec![(waygate_session::auth::EXT_AUDIENCE, bytes::Bytes::from(a))]
                        })
                        .unwrap_or_default(),
                };
                if connect {
                    let session_key: [u8; 32] = rand::random();
                    let token = waygate_session::auth::mint_connect_token(
                        key.id,
                        key.secret.as_bytes(),
                        &claims,
                        &session_key,
                        rand::random(),
                    )
                    .map_err(|e| e.to_string())?;
                    println!("{}", waygate_session::auth::token_to_base64url(&token));
                    println!("{}", waygate_session::auth::token_to_base64url(&session_key));
                    return Ok(());
                }
                let token = waygate_session::mint_token(key.id, key.secret.as_bytes(), &claims)
                    .map_err(|e| e.to_string())?;
                println!("{}", waygate_session::auth::token_to_base64url(&token));
                Ok(())
            }
            Command::Login {
                etcd,
                etcd_prefix,
                etcd_access,
                addr,
            } => {
                let mut source =
                    waygate_edge::cluster::etcd::EtcdSourceConfig::new(etcd.clone(), "");
                source.access = etcd_access.access(&etcd)?;
                let client = waygate_edge::cluster::etcd::connect_client(&source)
                    .await
                    .map_err(|e| format!("etcd {etcd:?}: {e}"))?;
                let app = waygate_edge::cluster::login::login_router(client, etcd_prefix);
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("{addr}: {e}"))?;
                let local = listener.local_addr().map_err(|e| e.to_string())?;
                println!("{}", serde_json::json!({"event": "ready", "login": local.to_string()}));
                axum::serve(listener, app).await.map_err(|e| e.to_string())
            }
            Command::Backend {
                addr,
                id,
                epoch,
                etcd,
                etcd_prefix,
                etcd_access,
                services,
                advertise,
                link_secret_file,
                insecure_open_links,
                tls_ca,
                tls_cert,
                tls_key,
            } => {
                let service = Arc::new(waygate_backend::demo::DemoService::new());
                let mut config = waygate_backend::BackendConfig::new(id.clone());
                config.link_secret = waygate_backend::load_link_secret(link_secret_file.as_deref())?;
                config.insecure_open_links = insecure_open_links;
                if let (Some(ca), Some(cert), Some(key)) = (tls_ca, tls_cert, tls_key) {
                    config.tls = Some(waygate_backend::link_tls::server_config(
                        &waygate_backend::link_tls::LinkTlsFiles { ca, cert, key },
                    )?);
                }
                let backend = waygate_backend::Backend::bind(addr, config, service)
                .await
                .map_err(|e| format!("backend {id} on {addr}: {e}"))?;
                backend.set_epoch(epoch);
                let backend = Arc::new(backend);
                if !etcd.is_empty() {
                    let address = advertise.unwrap_or_else(|| backend.local_addr().to_string());
                    let etcd = EtcdPlace {
                        endpoints: &etcd,
                        prefix: &etcd_prefix,
                        access: etcd_access.access(&etcd)?,
                    };
                    register_backend(&backend, &id, &address, etcd, &services).await?;
                }
                println!(
                    "{}",
                    serde_json::json!({"event": "ready", "backend": backend.local_addr().to_string(), "id": id})
                );
                tokio::signal::ctrl_c().await.map_err(|e| e.to_string())?;
                Ok(())
            }
            Command::Demo {
                clients,
                duration,
                json,
                edges,
                guilds,
                interval,
                world_every,
            } => {
                let options = waygate::demo::DemoOptions {
                    clients,
                    duration,
                    guilds,
                    interval,
                    world_every,
                    progress: !json,
                };
                let report = if edges > 1 {
                    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
                    waygate::demo::run_cluster(options, edges, &exe).await?
                } else {
                    waygate::demo::run(options).await?
                };
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
                    );
                    eprintln!("{}", report.verdict());
                } else {
                    print!("{}", report.table());
                }
                if report.ok() {
                    Ok(())
                } else {
                    Err(report.verdict())
                }
            }
            Command::Bench(args) => waygate::bench::run(*args).await,
            Command::Protocol => {
                println!(
                    "waygate client protocol v{}",
                    waygate_protocol::wire::PROTOCOL_VERSION
                );
                for code in waygate_protocol::wire::CloseCode::KNOWN {
                    println!("{:>5}  {}", code.to_u16(), code.as_str());
                }
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("waygate: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// One `POST` to an edge's admin server (HTTP/1.1 over TCP; no HTTP client needed): the
/// status and the body.
async fn admin_post(
    admin: SocketAddr,
    path: &str,
    token: Option<&str>,
) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut sock = tokio::net::TcpStream::connect(admin).await?;
        let auth = token
            .filter(|t| !t.is_empty())
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {admin}\r\nX-Waygate-Admin: cli\r\n{auth}\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        sock.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        sock.read_to_string(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(30), io)
        .await
        .map_err(|_| format!("{admin}: no answer in 30 s"))?
        .map_err(|e| format!("{admin}: {e}"))?;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// How a backend or the login service reaches etcd: the user it signs in as (etcd's
/// authentication) and TLS for `https://` endpoints.
#[derive(Debug, clap::Args)]
struct EtcdAccessArgs {
    /// The etcd user to sign in as (etcd with authentication enabled); its password comes
    /// from `--etcd-password-file` or `WAYGATE_ETCD_PASSWORD`.
    #[arg(long, default_value = "")]
    etcd_user: String,
    /// A file whose first line is the etcd user's password.
    #[arg(long, requires = "etcd_user")]
    etcd_password_file: Option<std::path::PathBuf>,
    /// PEM certificates `https://` etcd endpoints must chain to (default: the system's
    /// trusted roots).
    #[arg(long)]
    etcd_ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate presented to etcd (`--client-cert-auth`), with
    /// `--etcd-key-file`.
    #[arg(long, requires = "etcd_key_file")]
    etcd_cert_file: Option<std::path::PathBuf>,
    /// PEM private key of `--etcd-cert-file`.
    #[arg(long, requires = "etcd_cert_file")]
    etcd_key_file: Option<std::path::PathBuf>,
}

impl EtcdAccessArgs {
    /// The user and TLS for `endpoints`; warns of plaintext ones beyond loopback.
    fn access(
        &self,
        endpoints: &[String],
    ) -> Result<waygate_edge::cluster::etcd::EtcdAccess, String> {
        use waygate_edge::cluster::etcd::{EtcdAccess, EtcdCredentials, EtcdTls};
        for etcd in waygate_edge::config::plaintext_etcd_beyond_loopback(endpoints) {
            tracing::warn!(
                %etcd,
                "etcd beyond loopback without TLS: what this process sends it, the etcd \
                 password included, crosses the network in clear; use https:// (--etcd-ca-file)"
            );
        }
        let credentials =
            EtcdCredentials::load(&self.etcd_user, self.etcd_password_file.as_deref())
                .map_err(|e| e.to_string())?;
        let tls = EtcdTls::load(
            self.etcd_ca_file.as_deref(),
            self.etcd_cert_file.as_deref(),
            self.etcd_key_file.as_deref(),
        )
        .map_err(|e| e.to_string())?;
        Ok(EtcdAccess { credentials, tls })
    }
}

/// Where a backend registers: etcd's endpoints, key prefix, user and TLS.
struct EtcdPlace<'a> {
    endpoints: &'a [String],
    prefix: &'a str,
    access: waygate_edge::cluster::etcd::EtcdAccess,
}

/// Registers a backend instance in etcd under a lease for each service and keeps its load
/// report fresh (sessions, messages/s; R10). The leases die with the process.
async fn register_backend(
    backend: &Arc<waygate_backend::Backend>,
    id: &str,
    address: &str,
    etcd: EtcdPlace<'_>,
    services: &[String],
) -> Result<(), String> {
    use waygate_edge::cluster::etcd::EtcdRegistry;
    let registry = Arc::new(
        EtcdRegistry::connect(etcd.endpoints, etcd.prefix, etcd.access)
            .await
            .map_err(|e| format!("etcd {:?}: {e}", etcd.endpoints))?,
    );
    let spec = waygate_routing::InstanceSpec {
        id: id.to_owned(),
        address: address.to_owned(),
        weight: 1.0,
        state: waygate_routing::InstanceState::Active,
        capacity: None,
    };
    registry
        .register_backend_instance(
            services,
            &spec,
            std::time::Duration::from_secs(3),
            std::time::Duration::from_secs(1),
            backend.load_sampler(),
        )
        .await
        .map_err(|e| format!("registering {id} for {services:?}: {e}"))?;
    tracing::info!(%id, %address, ?services, "registered in etcd");
    Ok(())
}
