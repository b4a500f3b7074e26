//! The page at `GET /web/`: the daemon's own web UI (docs/web.md, "The
//! page"). Its HTML, CSS and JavaScript are files under `src/http/page/`,
//! embedded in the binary; there is no build step and nothing is fetched at
//! run time. The page talks to the daemon only over /web/ws, as any browser
//! app does, with the token it reads from its URL fragment (`#token=...`),
//! which browsers never send to the server.

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};

use super::auth::Route;
use super::error::WebError;
use super::routes::{check, WebState};

const INDEX_HTML: &str = include_str!("page/index.html");
const APP_JS: &str = include_str!("page/app.js");
const STYLE_CSS: &str = include_str!("page/style.css");

/// Where the page's model name goes in `index.html`.
const MODEL_PLACEHOLDER: &str = "{{MODEL}}";

/// Scripts and styles only from this listener, sockets only to it, and no
/// framing by other sites.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// The URL that opens the page with `token`: `serve --web` and
/// `superfluid open` print it.
pub fn url(addr: std::net::SocketAddr, token: &str) -> String {
    format!("http://{addr}/web/#token={token}")
}

pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/web", web::get().to(to_index))
        .route("/web/", web::get().to(index))
        .route("/web/app.js", web::get().to(script))
        .route("/web/style.css", web::get().to(style));
}

fn file(content_type: &str, body: String) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header((header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .body(body)
}

/// `/web` without its slash: the page's relative links need the slash. A
/// browser keeps the fragment (the token) across the redirect.
async fn to_index(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, WebError> {
    check(&state, Route::Page, &req)?;
    Ok(HttpResponse::PermanentRedirect()
        .insert_header((header::LOCATION, "/web/"))
        .finish())
}

async fn index(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, WebError> {
    check(&state, Route::Page, &req)?;
    let html = INDEX_HTML.replace(MODEL_PLACEHOLDER, &escape_html(&state.m().model.id));
    Ok(file("text/html; charset=utf-8", html))
}

async fn script(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, WebError> {
    check(&state, Route::Page, &req)?;
    Ok(file("text/javascript; charset=utf-8", APP_JS.to_string()))
}

async fn style(req: HttpRequest, state: web::Data<WebState>) -> Result<HttpResponse, WebError> {
    check(&state, Route::Page, &req)?;
    Ok(file("text/css; charset=utf-8", STYLE_CSS.to_string()))
}

/// Text made safe for an HTML attribute or element.
fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_name_is_escaped_into_the_page() {
        assert!(INDEX_HTML.contains(MODEL_PLACEHOLDER));
        assert_eq!(escape_html("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&#39;");
    }

    #[test]
    fn the_page_loads_only_its_own_files() {
        for needle in ["http://", "https://", "//cdn", "<script>"] {
            assert!(!INDEX_HTML.contains(needle), "index.html has {needle}");
        }
        assert!(INDEX_HTML.contains(r#"<script type="module" src="app.js">"#));
        assert!(APP_JS.contains("superfluid.token."));
    }

    #[test]
    fn the_url_carries_the_token_in_the_fragment() {
        assert_eq!(
            url("127.0.0.1:8455".parse().unwrap(), "ab12"),
            "http://127.0.0.1:8455/web/#token=ab12"
        );
    }
}
