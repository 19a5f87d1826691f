//! Defaults, precedence and every refusal naming its setting.

use std::collections::BTreeMap;

use super::settings::parse_properties;
use super::*;

#[test]
fn defaults_are_the_embedded_service() {
    let c = Config::default();
    assert_eq!(c.listen.to_string(), "127.0.0.1:50051");
    assert_eq!(c.database_url.0, "sqlite://mailroom.db");
    assert_eq!(c.sink, SinkConfig::Local { path: None });
    assert_eq!(c.limits.max_batch, 1000);
    assert_eq!(c.limits.max_payload_bytes, 1_015_820);
}

/// PostgreSQL relays carry longer runs by default; SQLite's one writer keeps them short;
/// an explicit setting wins on either.
#[test]
fn relay_cycles_are_longer_on_postgres() {
    let on = |url: &str, batch: Option<u32>| {
        Config::resolve(Settings {
            database_url: Some(url.into()),
            relay_batch_size: batch,
            ..Settings::default()
        })
        .unwrap()
        .relay
    };
    let pg = on("postgres://h/db", None);
    assert_eq!((pg.batch_size, pg.max_run), (5000, 5000));
    let lite = on("sqlite://x.db", None);
    assert_eq!((lite.batch_size, lite.max_run), (1000, 1000));
    assert_eq!(on("postgres://h/db", Some(200)).batch_size, 200);
}

/// The default payload limit leaves room in stock Kafka's record batch for the largest
/// headers and `RECORD_OVERHEAD_BYTES`, whatever `max_header_bytes` is (issue 23, item 5).
#[test]
fn the_default_payload_fits_stock_kafka() {
    use crate::sink::kafka::topic_limits::KAFKA_DEFAULT_MAX_MESSAGE_BYTES;
    use crate::sink::kafka::{RECORD_OVERHEAD_BYTES, record_bytes_needed};
    for headers in [None, Some(1024), Some(64 * 1024)] {
        let c = Config::resolve(Settings {
            max_header_bytes: headers,
            ..Settings::default()
        })
        .unwrap();
        let l = c.limits;
        assert_eq!(
            record_bytes_needed(l.max_payload_bytes, l.max_header_bytes),
            KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
            "{headers:?}"
        );
    }
    assert_eq!(RECORD_OVERHEAD_BYTES, 16 * 1024);
    let e = Config::resolve(Settings {
        max_header_bytes: Some(1024 * 1024),
        ..Settings::default()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("MAILROOM_MAX_PAYLOAD_BYTES"), "{e}");
    // An explicit payload limit is the operator's.
    let c = Config::resolve(Settings {
        max_payload_bytes: Some(1024 * 1024),
        ..Settings::default()
    })
    .unwrap();
    assert_eq!(c.limits.max_payload_bytes, 1024 * 1024);
}

#[test]
fn flags_beat_the_file() {
    let flags = Settings {
        listen: Some("127.0.0.1:1".into()),
        ..Default::default()
    };
    let file: Settings = toml::from_str("listen = \"127.0.0.1:2\"\nrelays = 3\n").unwrap();
    let c = Config::resolve(flags.or(file)).unwrap();
    assert_eq!(c.listen.port(), 1);
    assert_eq!(c.relays, 3);
}

#[test]
fn bad_settings_name_themselves() {
    let e = Config::resolve(Settings {
        listen: Some("nowhere".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("MAILROOM_LISTEN"), "{e}");
    let e = Config::resolve(Settings {
        database_url: Some("mysql://x".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("MAILROOM_DATABASE_URL"), "{e}");
    assert!(toml::from_str::<Settings>("no_such_setting = 1").is_err());
}

#[test]
fn the_console_is_closed_by_default_off_loopback() {
    let s = Settings {
        console_listen: Some("0.0.0.0:8080".into()),
        ..Settings::default()
    };
    let e = Config::resolve(s).unwrap_err().to_string();
    assert!(e.contains("MAILROOM_CONSOLE_LISTEN"), "{e}");
    let s = Settings {
        console_listen: Some("127.0.0.1:8080".into()),
        ..Settings::default()
    };
    assert!(Config::resolve(s).is_ok());
    let s = Settings {
        console_listen: Some("0.0.0.0:8080".into()),
        admin_token: Some("a-long-enough-admin-token".into()),
        ..Settings::default()
    };
    assert!(Config::resolve(s).is_ok());
}

#[test]
fn a_producer_record_limit_below_the_payload_limit_is_refused() {
    let s = Settings {
        kafka_brokers: Some("k:9092".into()),
        kafka_properties: Some(BTreeMap::from([(
            "message.max.bytes".to_string(),
            "1000000".to_string(),
        )])),
        ..Settings::default()
    };
    let e = Config::resolve(s).unwrap_err().to_string();
    assert!(e.contains("message.max.bytes=1000000"), "{e}");
    let s = Settings {
        kafka_brokers: Some("k:9092".into()),
        kafka_properties: Some(BTreeMap::from([(
            "message.max.bytes".to_string(),
            "1000000".to_string(),
        )])),
        max_payload_bytes: Some(900_000),
        ..Settings::default()
    };
    assert!(Config::resolve(s).is_ok());
}

#[test]
fn byte_budgets_have_defaults_and_bounds() {
    let c = Config::resolve(Settings::default()).unwrap();
    assert_eq!(c.max_batch_bytes, 64 * 1024 * 1024);
    assert_eq!(c.relay.max_bytes, 64 * 1024 * 1024);
    assert_eq!(c.intake.queue_bytes, 256 * 1024 * 1024);
    assert!(enqueue_request_bytes(&c.limits) < 2 * 1024 * 1024);
    let e = Config::resolve(Settings {
        max_batch_bytes: Some(1000),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("MAILROOM_MAX_BATCH_BYTES"), "{e}");
    let e = Config::resolve(Settings {
        intake_queue_bytes: Some(1024 * 1024),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("MAILROOM_INTAKE_QUEUE_BYTES"), "{e}");
    let e = Config::resolve(Settings {
        relay_max_bytes: Some(0),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("MAILROOM_RELAY_MAX_BYTES"), "{e}");
}

#[test]
fn kafka_properties_parse() {
    let p = parse_properties("security.protocol=SASL_SSL, sasl.mechanism=PLAIN").unwrap();
    assert_eq!(p["security.protocol"], "SASL_SSL");
    assert!(parse_properties("oops").is_err());
}

#[test]
fn passwords_are_redacted() {
    assert_eq!(
        redact_url("postgres://u:secret@h:5432/db"),
        "postgres://u:***@h:5432/db"
    );
    assert_eq!(redact_url("sqlite://x.db"), "sqlite://x.db");
    // Every form a password can take in a URL.
    assert_eq!(
        redact_url("postgres://u:p%40ss@h/db?password=hunter2&sslmode=verify-full"),
        "postgres://u:***@h/db?password=***&sslmode=verify-full"
    );
    assert_eq!(
        redact_url("postgresql://h/db?user=u&PASSWORD=x&sslpassword=y&sslkey=/k.pem"),
        "postgresql://h/db?user=u&PASSWORD=***&sslpassword=***&sslkey=***"
    );
    assert_eq!(redact_url("postgres://u:a@b@h/db"), "postgres://u:***@h/db");
}

#[test]
fn a_malformed_config_file_is_reported_without_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mailroom.toml");
    for text in [
        "database_url = \"postgres://u:hunter2-secret@h/db\"\nrelays = \"two\"\n",
        "database_url = \"postgres://u:hunter2-secret@h/db\n",
        "database_url = postgres://u:hunter2-secret@h/db\n",
        "admin_token = 1234hunter2-secret\n",
    ] {
        std::fs::write(&p, text).unwrap();
        let e = Config::load(Settings {
            config: Some(p.clone()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("line "), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
    std::fs::write(&p, "no_such_setting = 1\n").unwrap();
    let e = Config::load(Settings {
        config: Some(p.clone()),
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("no_such_setting"), "{e}");
}

#[test]
fn closed_by_default_on_the_network() {
    // Non-loopback, no token: one line naming the setting and the way out.
    let e = Config::resolve(Settings {
        listen: Some("0.0.0.0:50051".into()),
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("MAILROOM_LISTEN"), "{e}");
    assert!(e.contains("--allow-unauthenticated"), "{e}");
    assert_eq!(e.lines().count(), 1);
    // The legacy admin token alone leaves Enqueue open: still refused.
    assert!(
        Config::resolve(Settings {
            listen: Some("0.0.0.0:50051".into()),
            admin_token: Some("a-long-enough-admin-token".into()),
            ..Default::default()
        })
        .is_err()
    );
    let c = Config::resolve(Settings {
        listen: Some("0.0.0.0:50051".into()),
        allow_unauthenticated: Some(true),
        ..Default::default()
    })
    .unwrap();
    assert!(c.open_on_network);
    let c = Config::resolve(Settings {
        listen: Some("127.0.0.1:50051".into()),
        ..Default::default()
    })
    .unwrap();
    assert!(!c.open_on_network);
    let e = Config::resolve(Settings {
        admin_token: Some("short".into()),
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("MAILROOM_ADMIN_TOKEN") && e.contains("shorter"),
        "{e}"
    );
    assert!(!e.contains("short\""), "{e}");
}

/// Issue 25, item 5: secrets come from files, and no `Debug` of the settings or the
/// configuration shows them.
#[test]
fn secrets_come_from_files_and_debug_shows_none() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let s = Settings {
        database_url_file: Some(write("db", "postgres://app:db-pass-4711@db/mailroom\n")),
        admin_token_file: Some(write("admin", "admin-token-0123456789-4711\n")),
        kafka_brokers: Some("kafka:9092".into()),
        kafka_properties: Some([("security.protocol".into(), "SASL_SSL".into())].into()),
        kafka_properties_file: Some(write(
            "kafka",
            "# SASL\nsasl.username = app\nsasl.password = kafka-pass-4711\n",
        )),
        ..Default::default()
    };
    let settings_debug = format!("{s:?}");
    let c = Config::resolve(s).unwrap();
    assert_eq!(c.database_url.0, "postgres://app:db-pass-4711@db/mailroom");
    assert_eq!(
        c.admin_token.as_ref().unwrap().0,
        "admin-token-0123456789-4711"
    );
    let SinkConfig::Kafka { properties, .. } = &c.sink else {
        panic!("{:?}", c.sink)
    };
    assert_eq!(properties["sasl.password"], "kafka-pass-4711");
    assert_eq!(properties["security.protocol"], "SASL_SSL");
    let config_debug = format!("{c:?}");
    for shown in [&settings_debug, &config_debug] {
        assert!(!shown.contains("4711"), "a secret in Debug: {shown}");
    }
    assert!(
        config_debug.contains("SASL_SSL"),
        "other properties still show"
    );
    // A value given both ways is refused, naming the setting and not the value.
    let err = Config::resolve(Settings {
        database_url: Some("sqlite://x.db".into()),
        database_url_file: Some(write("db2", "postgres://a:b@c/d")),
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("MAILROOM_DATABASE_URL_FILE"), "{err}");
}

#[test]
fn intake_overlap_has_a_default_and_a_bound() {
    let c = Config::resolve(Settings::default()).unwrap();
    assert_eq!(c.intake.overlap_after, Duration::from_millis(20));
    let c = Config::resolve(Settings {
        intake_overlap_ms: Some(0),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(c.intake.overlap_after, Duration::ZERO);
    let e = Config::resolve(Settings {
        intake_overlap_ms: Some(1001),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("MAILROOM_INTAKE_OVERLAP_MS"), "{e}");
}

/// The migrator's lock wait: short by default, bounded below so that a try can succeed,
/// and the whole wait at least one try.
#[test]
fn migration_lock_waits_have_defaults_and_bounds() {
    let c = Config::resolve(Settings::default()).unwrap();
    assert_eq!(c.migration.lock_timeout, Duration::from_millis(500));
    assert_eq!(c.migration.max_wait, Duration::from_secs(600));
    let c = Config::resolve(Settings {
        migration_lock_timeout_ms: Some(0),
        migration_max_wait_ms: Some(0),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(c.migration.lock_timeout, Duration::from_millis(10));
    assert_eq!(c.migration.max_wait, Duration::from_millis(10));
    let c = Config::resolve(Settings {
        migration_lock_timeout_ms: Some(2000),
        migration_max_wait_ms: Some(60_000),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(c.migration.lock_timeout, Duration::from_secs(2));
    assert_eq!(c.migration.max_wait, Duration::from_secs(60));
}
