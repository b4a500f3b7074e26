//! Who may use the browser transport: one pure function, `authorize`, over
//! the headers a request presents. The handlers only collect the headers
//! and turn a `Denied` into its status (in `error`).
//!
//! - **Host** must be the listener's own `ip:port` or `localhost:port`, on
//!   every route but /web/health: a page on a rebound DNS name gets nothing.
//!   /web/health is open to any Host, as the spec says ("200, without a
//!   token"): it tells only that the daemon answers and its lane's state.
//! - **Token** (401): `Authorization: Bearer <token>`, or on /web/ws a
//!   `superfluid.token.<token>` subprotocol (a browser cannot set headers
//!   on a WebSocket). Compared in constant time.
//! - **Origin** (403): /web/ws requires the listener's own origin
//!   (`http://127.0.0.1:PORT`, `http://localhost:PORT`: the page at /web/)
//!   or one listed by `--web-origin`; on /web/rpc and /web/stream one that
//!   is present must be listed.
//! - **The page** (/web/ and its script and style): Host only. It holds no
//!   secret; the token reaches it in the URL fragment, which no browser sends.
//! - **CSRF** (403): /web/rpc and /web/stream also need the token again as
//!   `X-Superfluid-CSRF`, a header no cross-site form can set.
//! - **The compatible routes** (/v1/*, /api/*, /metrics: `Route::Api`): the
//!   token or the `--api-key` value, as `Authorization: Bearer` (OpenAI's
//!   SDK) or `x-api-key` (Anthropic's); an `Origin` that is present must be
//!   listed (a web page must not drive the model with the user's key); no
//!   CSRF header (the SDKs send none, and the Origin rule covers browsers).

use super::token;

/// The subprotocol /web/ws speaks.
pub const PROTOCOL: &str = "superfluid.v1";
/// The prefix of the subprotocol that carries the token.
pub const TOKEN_PROTOCOL_PREFIX: &str = "superfluid.token.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// /web/rpc and /web/stream.
    Post,
    Ws,
    Health,
    /// The page at /web/ and its files: Host only.
    Page,
    /// The OpenAI, Anthropic and metrics routes.
    Api,
}

/// What the listener accepts.
#[derive(Debug, Clone)]
pub struct Policy {
    pub token: String,
    /// `ip:port` and `localhost:port` of the listener.
    pub hosts: Vec<String>,
    /// `--web-origin`, as given.
    pub origins: Vec<String>,
    /// `http://` and each of `hosts`: the page this listener serves, which
    /// /web/ws accepts without `--web-origin`.
    pub own_origins: Vec<String>,
    /// `--api-key`: a stable key the compatible routes also accept.
    pub api_key: Option<String>,
}

impl Policy {
    pub fn new(token: String, addr: std::net::SocketAddr, origins: Vec<String>) -> Policy {
        let hosts = vec![addr.to_string(), format!("localhost:{}", addr.port())];
        Policy {
            token,
            own_origins: hosts.iter().map(|h| format!("http://{h}")).collect(),
            hosts,
            origins: origins
                .into_iter()
                .map(|o| o.trim_end_matches('/').to_string())
                .collect(),
            api_key: None,
        }
    }

    /// Also accept `key` on the compatible routes.
    pub fn with_api_key(mut self, key: Option<String>) -> Policy {
        self.api_key = key.filter(|k| !k.is_empty());
        self
    }
}

/// The headers that matter, as the request presented them (`None` when
/// absent or not text).
#[derive(Debug, Default, Clone)]
pub struct Presented<'a> {
    pub host: Option<&'a str>,
    pub origin: Option<&'a str>,
    pub authorization: Option<&'a str>,
    pub csrf: Option<&'a str>,
    /// `x-api-key` (the compatible routes).
    pub api_key: Option<&'a str>,
    /// Every `Sec-WebSocket-Protocol` entry.
    pub protocols: Vec<&'a str>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("the Host header names neither this listener nor localhost")]
    ForeignHost,
    #[error("missing or wrong token")]
    Token,
    #[error("this Origin is not listed by --web-origin")]
    Origin,
    #[error("missing or wrong X-Superfluid-CSRF header")]
    Csrf,
}

/// Decides one request. Checked in this order: Host, token, Origin, CSRF;
/// /web/health checks none of them, the page only Host.
pub fn authorize(policy: &Policy, route: Route, p: &Presented) -> Result<(), Denied> {
    if route == Route::Health {
        return Ok(());
    }
    let host_ok = p
        .host
        .is_some_and(|h| policy.hosts.iter().any(|ok| ok.eq_ignore_ascii_case(h)));
    if !host_ok {
        return Err(Denied::ForeignHost);
    }
    if route == Route::Page {
        return Ok(());
    }
    let bearer = p.authorization.and_then(|a| {
        let (scheme, rest) = a.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
    });
    let from_protocol = || {
        p.protocols
            .iter()
            .find_map(|s| s.trim().strip_prefix(TOKEN_PROTOCOL_PREFIX))
    };
    let presented = match route {
        Route::Ws => bearer.or_else(from_protocol),
        Route::Api => bearer.or(p.api_key.map(str::trim)),
        _ => bearer,
    };
    let accepted = |t: &str| {
        token::matches(&policy.token, t)
            || (route == Route::Api
                && policy
                    .api_key
                    .as_deref()
                    .is_some_and(|k| token::matches(k, t)))
    };
    if !presented.is_some_and(accepted) {
        return Err(Denied::Token);
    }
    let listed = |o: &str| {
        policy
            .origins
            .iter()
            .any(|ok| ok.eq_ignore_ascii_case(o.trim_end_matches('/')))
    };
    let own = |o: &str| {
        policy
            .own_origins
            .iter()
            .any(|ok| ok.eq_ignore_ascii_case(o.trim_end_matches('/')))
    };
    match (route, p.origin) {
        (Route::Ws, Some(o)) if own(o) => {}
        (Route::Ws, Some(o)) | (Route::Post, Some(o)) | (Route::Api, Some(o)) if !listed(o) => {
            return Err(Denied::Origin)
        }
        (Route::Ws, None) => return Err(Denied::Origin),
        _ => {}
    }
    if route == Route::Post
        && !p
            .csrf
            .is_some_and(|c| token::matches(&policy.token, c.trim()))
    {
        return Err(Denied::Csrf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "0123abcd";

    fn policy() -> Policy {
        Policy::new(
            T.into(),
            "127.0.0.1:8455".parse().unwrap(),
            vec!["http://localhost:5173/".into()],
        )
    }

    fn good(route: Route) -> Presented<'static> {
        Presented {
            host: Some("127.0.0.1:8455"),
            origin: (route == Route::Ws).then_some("http://localhost:5173"),
            authorization: Some("Bearer 0123abcd"),
            csrf: Some(T),
            api_key: None,
            protocols: vec![],
        }
    }

    #[test]
    fn api_routes_take_the_token_or_the_api_key_by_either_header() {
        let p = policy().with_api_key(Some("stable-key".into()));
        let base = Presented {
            host: Some("localhost:8455"),
            ..Presented::default()
        };
        let with = |authorization, api_key| Presented {
            authorization,
            api_key,
            ..base.clone()
        };
        for ok in [
            with(Some("Bearer stable-key"), None),
            with(Some("Bearer 0123abcd"), None),
            with(None, Some("stable-key")),
            with(None, Some(T)),
        ] {
            assert_eq!(authorize(&p, Route::Api, &ok), Ok(()), "{ok:?}");
        }
        assert_eq!(
            authorize(&p, Route::Api, &with(None, Some("nope"))),
            Err(Denied::Token)
        );
        assert_eq!(authorize(&p, Route::Api, &base), Err(Denied::Token));
        // The API key is for the compatible routes only.
        assert_eq!(
            authorize(
                &p,
                Route::Post,
                &Presented {
                    csrf: Some("stable-key"),
                    ..with(Some("Bearer stable-key"), None)
                }
            ),
            Err(Denied::Token)
        );
        // An Origin that is present must be listed; none is needed.
        let page = Presented {
            origin: Some("http://evil.example"),
            ..with(None, Some("stable-key"))
        };
        assert_eq!(authorize(&p, Route::Api, &page), Err(Denied::Origin));
        let foreign = Presented {
            host: Some("evil.example:8455"),
            ..with(None, Some("stable-key"))
        };
        assert_eq!(
            authorize(&p, Route::Api, &foreign),
            Err(Denied::ForeignHost)
        );
    }

    #[test]
    fn the_matrix() {
        let p = policy();
        for route in [Route::Post, Route::Ws] {
            let ok = good(route);
            assert_eq!(authorize(&p, route, &ok), Ok(()));
            let cases: Vec<(Presented, Denied)> = vec![
                (
                    Presented {
                        authorization: None,
                        ..ok.clone()
                    },
                    Denied::Token,
                ),
                (
                    Presented {
                        authorization: Some("Bearer 0123abce"),
                        ..ok.clone()
                    },
                    Denied::Token,
                ),
                (
                    Presented {
                        authorization: Some("Basic 0123abcd"),
                        ..ok.clone()
                    },
                    Denied::Token,
                ),
                (
                    Presented {
                        origin: Some("http://evil.example"),
                        ..ok.clone()
                    },
                    Denied::Origin,
                ),
                (
                    Presented {
                        host: Some("evil.example:8455"),
                        ..ok.clone()
                    },
                    Denied::ForeignHost,
                ),
                (
                    Presented {
                        host: Some("localhost:9999"),
                        ..ok.clone()
                    },
                    Denied::ForeignHost,
                ),
                (
                    Presented {
                        host: None,
                        ..ok.clone()
                    },
                    Denied::ForeignHost,
                ),
            ];
            for (presented, denied) in cases {
                assert_eq!(
                    authorize(&p, route, &presented),
                    Err(denied),
                    "{route:?} {presented:?}"
                );
            }
        }
        let post = good(Route::Post);
        for csrf in [None, Some("nope")] {
            let presented = Presented {
                csrf,
                ..post.clone()
            };
            assert_eq!(authorize(&p, Route::Post, &presented), Err(Denied::Csrf));
        }
        // No Origin: fine for curl on /web/rpc, refused on /web/ws.
        assert_eq!(
            authorize(
                &p,
                Route::Post,
                &Presented {
                    origin: None,
                    ..post
                }
            ),
            Ok(())
        );
        let ws = good(Route::Ws);
        assert_eq!(
            authorize(
                &p,
                Route::Ws,
                &Presented {
                    origin: None,
                    ..ws.clone()
                }
            ),
            Err(Denied::Origin)
        );
        // A WebSocket needs no CSRF header, and takes the token as a subprotocol.
        let browser = Presented {
            authorization: None,
            csrf: None,
            host: Some("localhost:8455"),
            protocols: vec![PROTOCOL, "superfluid.token.0123abcd"],
            ..ws.clone()
        };
        assert_eq!(authorize(&p, Route::Ws, &browser), Ok(()));
        let wrong = Presented {
            protocols: vec![PROTOCOL, "superfluid.token.x"],
            ..browser
        };
        assert_eq!(authorize(&p, Route::Ws, &wrong), Err(Denied::Token));
        // The subprotocol is no credential on /web/rpc.
        let sub_only = Presented {
            authorization: None,
            protocols: vec!["superfluid.token.0123abcd"],
            ..good(Route::Post)
        };
        assert_eq!(authorize(&p, Route::Post, &sub_only), Err(Denied::Token));
    }

    /// The page this listener serves may open /web/ws from either of its
    /// origins without --web-origin; the token is still required, and the
    /// own origin is no pass for /web/rpc or a look-alike origin.
    #[test]
    fn the_listeners_own_origin_is_accepted_on_ws_only() {
        let p = Policy::new(T.into(), "127.0.0.1:8455".parse().unwrap(), vec![]);
        let page = |origin| Presented {
            host: Some("127.0.0.1:8455"),
            origin: Some(origin),
            protocols: vec![PROTOCOL, "superfluid.token.0123abcd"],
            ..Presented::default()
        };
        for origin in [
            "http://127.0.0.1:8455",
            "http://localhost:8455",
            "http://LOCALHOST:8455/",
        ] {
            assert_eq!(authorize(&p, Route::Ws, &page(origin)), Ok(()), "{origin}");
        }
        for origin in [
            "http://127.0.0.1:8456",
            "https://127.0.0.1:8455",
            "http://localhost:8455.evil.example",
            "http://evil.example",
        ] {
            assert_eq!(
                authorize(&p, Route::Ws, &page(origin)),
                Err(Denied::Origin),
                "{origin}"
            );
        }
        let no_token = Presented {
            protocols: vec![PROTOCOL],
            ..page("http://localhost:8455")
        };
        assert_eq!(authorize(&p, Route::Ws, &no_token), Err(Denied::Token));
        let post = Presented {
            authorization: Some("Bearer 0123abcd"),
            csrf: Some(T),
            ..page("http://localhost:8455")
        };
        assert_eq!(authorize(&p, Route::Post, &post), Err(Denied::Origin));
        let v6 = Policy::new(T.into(), "[::1]:8455".parse().unwrap(), vec![]);
        let page_v6 = Presented {
            host: Some("[::1]:8455"),
            ..page("http://[::1]:8455")
        };
        assert_eq!(authorize(&v6, Route::Ws, &page_v6), Ok(()));
    }

    /// The page needs the listener's Host and nothing else.
    #[test]
    fn the_page_checks_only_host() {
        let p = policy();
        let bare = Presented {
            host: Some("localhost:8455"),
            origin: Some("http://evil.example"),
            ..Presented::default()
        };
        assert_eq!(authorize(&p, Route::Page, &bare), Ok(()));
        let foreign = Presented {
            host: Some("evil.example:8455"),
            ..bare
        };
        assert_eq!(
            authorize(&p, Route::Page, &foreign),
            Err(Denied::ForeignHost)
        );
    }

    #[test]
    fn health_checks_nothing() {
        let p = policy();
        let bare = Presented {
            host: Some("LOCALHOST:8455"),
            ..Presented::default()
        };
        assert_eq!(authorize(&p, Route::Health, &bare), Ok(()));
        for host in [Some("evil:8455"), None] {
            let foreign = Presented {
                host,
                ..bare.clone()
            };
            assert_eq!(authorize(&p, Route::Health, &foreign), Ok(()));
        }
    }
}
