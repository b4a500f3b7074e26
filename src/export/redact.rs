//! The redaction pass on exported content: a table of known secret shapes,
//! each match replaced by `[REDACTED:<kind>]`. It runs on every string an
//! export writes from a session's content (`--include-content`); without
//! that flag no content is written at all.
//!
//! The table favours shapes with a fixed, distinctive prefix (`AKIA`,
//! `ghp_`, `sk-ant-`, PEM armour) so that prose and code do not match; the
//! one loose shape, `password=`-style assignments, only takes a quoted
//! literal or an unquoted value with a digit or a symbol in it, so that
//! `password = read_password()` and `login(password=password)` stay as they
//! are. docs/export.md lists the table.

use std::borrow::Cow;
use std::sync::LazyLock;

use regex::{Captures, Regex};

/// One secret shape.
struct Shape {
    /// Named in the marker: `[REDACTED:<kind>]`.
    kind: &'static str,
    re: Regex,
}

/// Applied in this order: a specific shape before a looser one that could
/// also match it (Anthropic's `sk-ant-` before OpenAI's `sk-`).
const SHAPES: &[(&str, &str)] = &[
    (
        "pem_private_key",
        r"(?s)-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?-----END [A-Z0-9 ]*PRIVATE KEY-----",
    ),
    (
        "aws_access_key_id",
        r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b",
    ),
    (
        "aws_secret_access_key",
        r#"(?i)\baws_?secret_?access_?key["']?\s*[:=]\s*["']?[A-Za-z0-9/+]{40}\b["']?"#,
    ),
    ("gcp_api_key", r"\bAIza[0-9A-Za-z_\-]{35}"),
    ("azure_storage_key", r"(?i)\bAccountKey=[A-Za-z0-9+/]{86}=="),
    (
        "github_token",
        r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}\b",
    ),
    ("github_token", r"\bgithub_pat_[A-Za-z0-9_]{82}\b"),
    ("gitlab_token", r"\bglpat-[A-Za-z0-9_\-]{20,}"),
    ("slack_token", r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"),
    (
        "slack_webhook",
        r"https://hooks\.slack\.com/services/T[A-Za-z0-9]+/B[A-Za-z0-9]+/[A-Za-z0-9]+",
    ),
    ("anthropic_key", r"\bsk-ant-[a-z]+\d{2}-[A-Za-z0-9_\-]{80,}"),
    (
        "openai_key",
        r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]*[A-Za-z0-9]{20,}[A-Za-z0-9_\-]*",
    ),
    ("huggingface_token", r"\bhf_[A-Za-z0-9]{34,}\b"),
    (
        "jwt",
        r"\beyJ[A-Za-z0-9_\-]{4,}\.eyJ[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]{10,}",
    ),
];

/// `password=hunter2`, `"secret": "..."`, `API_KEY='...'`: the key and its
/// separator stay, the value goes.
const ASSIGNMENT: &str = r#"(?i)(?P<key>\b[a-z0-9_]*(?:password|passwd|pwd|secret|api_?key|access_?token|auth_?token)(?:_?key)?["']?)(?:(?P<sep>\s*[:=]\s*)(?P<quoted>"[^"\n]{4,}"|'[^'\n]{4,}')|(?P<eq>=)(?P<bare>[^\s"'`,;()\[\]{}<>]+))"#;

/// The marker of an assignment's value.
const ASSIGNMENT_KIND: &str = "secret_assignment";

static TABLE: LazyLock<Vec<Shape>> = LazyLock::new(|| {
    SHAPES
        .iter()
        .map(|(kind, re)| Shape {
            kind,
            re: Regex::new(re).expect("the table's patterns compile"),
        })
        .collect()
});

static ASSIGNMENT_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(ASSIGNMENT).expect("the assignment pattern compiles"));

/// The marker that replaces a secret of `kind`.
pub fn marker(kind: &str) -> String {
    format!("[REDACTED:{kind}]")
}

/// Whether an unquoted assignment value looks like a secret rather than a
/// name: it has a digit or a symbol an identifier lacks, and is not a
/// placeholder (`$VAR`, `%s`, `{}`).
fn bare_value_is_secret(v: &str) -> bool {
    let placeholder =
        v.starts_with(['$', '%', '{', '*']) || v.chars().all(|c| c == 'x' || c == 'X');
    let marked = v.starts_with("[REDACTED:");
    let secretish = v
        .chars()
        .any(|c| c.is_ascii_digit() || !(c.is_alphanumeric() || c == '_' || c == '.'));
    !placeholder && !marked && secretish
}

/// A quoted value that is a placeholder rather than a secret.
fn quoted_is_placeholder(q: &str) -> bool {
    let inner = &q[1..q.len() - 1];
    inner.starts_with(['$', '%', '{', '<'])
        || inner.starts_with("[REDACTED:")
        || inner
            .chars()
            .all(|c| c == '*' || c == 'x' || c == 'X' || c == '.')
}

/// `text` with every secret of the table replaced by its marker, and how
/// many were replaced.
pub fn redact(text: &str) -> (Cow<'_, str>, usize) {
    let mut out = Cow::Borrowed(text);
    let mut n = 0usize;
    for shape in TABLE.iter() {
        let found = shape.re.find_iter(&out).count();
        if found > 0 {
            n += found;
            let replaced = shape
                .re
                .replace_all(&out, marker(shape.kind).as_str())
                .into_owned();
            out = Cow::Owned(replaced);
        }
    }
    let mut hits = 0usize;
    let replaced = ASSIGNMENT_RE.replace_all(&out, |c: &Captures| {
        let key = &c["key"];
        if let Some(q) = c.name("quoted") {
            if quoted_is_placeholder(q.as_str()) {
                return c[0].to_string();
            }
            hits += 1;
            let quote = &q.as_str()[..1];
            return format!(
                "{key}{}{quote}{}{quote}",
                &c["sep"],
                marker(ASSIGNMENT_KIND)
            );
        }
        let bare = c.name("bare").map_or("", |m| m.as_str());
        if !bare_value_is_secret(bare) {
            return c[0].to_string();
        }
        hits += 1;
        format!("{key}={}", marker(ASSIGNMENT_KIND))
    });
    if hits > 0 {
        out = Cow::Owned(replaced.into_owned());
        n += hits;
    }
    (out, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn only(text: &str) -> String {
        redact(text).0.into_owned()
    }

    /// Each shape of the table, in a sentence: the secret goes, the
    /// sentence stays, the marker names the kind.
    #[test]
    fn every_shape_is_replaced_by_its_marker() {
        let a40 = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
        let cases: Vec<(String, &str)> = vec![
            ("key AKIAIOSFODNN7EXAMPLE here".into(), "aws_access_key_id"),
            ("key ASIAY34FZKBOKMUTVV7A here".into(), "aws_access_key_id"),
            (
                format!("aws_secret_access_key = {a40}"),
                "aws_secret_access_key",
            ),
            (
                "k=AIzaSyA1bC2dE3fG4hI5jK6lM7nO8pQ9rS0tUvW end".into(),
                "gcp_api_key",
            ),
            (
                format!(
                    "DefaultEndpointsProtocol=https;AccountName=x;AccountKey={}==;EndpointSuffix=core",
                    "a".repeat(40) + &"B1+/".repeat(11) + "cd"
                ),
                "azure_storage_key",
            ),
            (
                format!("token ghp_{} ok", "A1b2C3d4E5".repeat(3) + "f6G7h8"),
                "github_token",
            ),
            (
                format!("token github_pat_{} ok", "a1B2_".repeat(16) + "xy"),
                "github_token",
            ),
            ("glpat-xYz123AbC456dEf789gH ok".into(), "gitlab_token"),
            (
                "slack xoxb-1234567890-0987654321-AbCdEfGhIjKl ok".into(),
                "slack_token",
            ),
            (
                "hook https://hooks.slack.com/services/T0000/B0000/XXXXabcd1234 ok".into(),
                "slack_webhook",
            ),
            (
                format!("k sk-ant-api03-{} ok", "Ab1_-".repeat(18)),
                "anthropic_key",
            ),
            (
                "k sk-proj-Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv ok".into(),
                "openai_key",
            ),
            (
                "k sk-Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv ok".into(),
                "openai_key",
            ),
            (
                "k hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567 ok".into(),
                "huggingface_token",
            ),
            (
                "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U".into(),
                "jwt",
            ),
            (
                "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nabc==\n-----END RSA PRIVATE KEY-----".into(),
                "pem_private_key",
            ),
            (
                "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAA\n-----END OPENSSH PRIVATE KEY-----".into(),
                "pem_private_key",
            ),
            ("PASSWORD=hunter2".into(), ASSIGNMENT_KIND),
            ("db_password = \"correct horse\"".into(), ASSIGNMENT_KIND),
            ("{\"client_secret\": \"s3cr3t-value\"}".into(), ASSIGNMENT_KIND),
            ("export API_KEY='abcd-efgh'".into(), ASSIGNMENT_KIND),
            ("https://x/?user=a&password=p%40ss1".into(), ASSIGNMENT_KIND),
        ];
        for (text, kind) in cases {
            let (out, n) = redact(&text);
            assert!(
                out.contains(&marker(kind)),
                "{text:?} -> {out:?}: no {kind} marker"
            );
            assert!(n >= 1, "{text:?}");
            // Nothing of a long secret is left: no run of 10 characters
            // of the original value survives next to the marker.
            assert_ne!(out, text.as_str());
        }
    }

    #[test]
    fn the_secret_itself_is_gone_and_the_rest_stays() {
        let (out, n) = redact("use AKIAIOSFODNN7EXAMPLE and PASSWORD=hunter2 please");
        assert_eq!(
            out,
            "use [REDACTED:aws_access_key_id] and PASSWORD=[REDACTED:secret_assignment] please"
        );
        assert_eq!(n, 2);
        let (out, _) = redact("{\"password\": \"hunter22\"}");
        assert_eq!(out, "{\"password\": \"[REDACTED:secret_assignment]\"}");
        let pem = "a\n-----BEGIN PRIVATE KEY-----\nMIIE\nxyz\n-----END PRIVATE KEY-----\nb";
        assert_eq!(only(pem), "a\n[REDACTED:pem_private_key]\nb");
    }

    #[test]
    fn anthropic_keys_are_not_called_openai_keys() {
        let key = format!("sk-ant-api03-{}", "Ab1_-".repeat(18));
        assert_eq!(only(&key), "[REDACTED:anthropic_key]");
    }

    #[test]
    fn redacting_twice_changes_nothing_more() {
        let once = only("PASSWORD=hunter2 AKIAIOSFODNN7EXAMPLE \"secret\": \"abcdefgh\"");
        let (twice, n) = redact(&once);
        assert_eq!(twice, once);
        assert_eq!(n, 0);
    }

    /// Ordinary prose and code: nothing matches.
    #[test]
    fn prose_and_code_are_left_alone() {
        let corpus = [
            "The password is something only you should know; never share your secret.",
            "Set a strong password: at least twelve characters, mixed case.",
            "let password = read_password()?;",
            "if password == expected { return Ok(()) }",
            "def login(user, password=password, secret=None):",
            "conn = connect(host, password=pw)",
            "password = os.environ[\"DB_PASSWORD\"]",
            "PASSWORD=${DB_PASSWORD} ./run.sh",
            "secret_key = settings.SECRET_KEY",
            "api_key: str = Field(default=None)",
            "\"password\": \"\"",
            "The AWS docs describe AKIA prefixes for access key ids.",
            "skip-this-step and sk-learn are not keys; neither is task-1234.",
            "The GitHub token starts with ghp_ followed by characters.",
            "Use hf_hub_download to fetch a file; hf_transfer speeds it up.",
            "eyJ is how base64 of a JSON object starts.",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",
            "-----BEGIN PUBLIC KEY-----\nMIIB\n-----END PUBLIC KEY-----",
            "fn main() { let xs: Vec<u64> = (0..10).collect(); println!(\"{xs:?}\"); }",
            "SELECT id, name FROM users WHERE active = 1 ORDER BY created_at DESC;",
            "git commit -m 'fix: handle the token bucket refill' && git push",
            "The model returned 1234567890 tokens with sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855.",
            "https://example.com/search?q=password+reset&page=2",
            "token_bucket = TokenBucket(capacity=10, refill=2)",
            "xoxo, see you tomorrow",
        ];
        for text in corpus {
            let (out, n) = redact(text);
            assert_eq!((out.as_ref(), n), (text, 0), "false positive");
        }
    }
}
