package oidctest

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
)

// CodeLifetime is how long an authorization code can be exchanged.
const CodeLifetime = time.Minute

// The authorization code flow (RFC 6749 §4.1) with PKCE (RFC 7636, S256
// only), as an MCP client drives it: /authorize signs the provider's user in
// at once (no login page) and redirects to the client with a code; /token
// exchanges the code, once, for an id_token and a JWT access token whose aud
// is the client's id, as Dex issues them. Clients are public (no secret) and
// registered with AddClient.

// Grant is a code the provider exchanged for tokens: what the client asked
// for.
type Grant struct {
	ClientID    string
	RedirectURI string
	Scope       string
	// Resource is the RFC 8707 resource indicator the client sent with the
	// authorization request (an MCP client sends its server's URL).
	Resource string
}

type pendingCode struct {
	Grant
	challenge string // the PKCE S256 code_challenge
	nonce     string
	user      Claims
	expires   time.Time
}

// AddClient registers a public client and the redirect URIs it may use
// (compared exactly).
func (p *Provider) AddClient(id string, redirectURIs ...string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.clients == nil {
		p.clients = map[string][]string{}
	}
	p.clients[id] = append(p.clients[id], redirectURIs...)
}

// SetUser sets the claims of the user /authorize signs in from now on (the
// zero Claims: subject user-1). An Audience left nil becomes the client's id.
func (p *Provider) SetUser(c Claims) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.user = c
}

// Grants are the codes exchanged so far, oldest first.
func (p *Provider) Grants() []Grant {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.grants)
}

func (p *Provider) authorize(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	clientID, redirectURI := q.Get("client_id"), q.Get("redirect_uri")
	p.mu.Lock()
	registered := slices.Contains(p.clients[clientID], redirectURI)
	user := p.user
	p.mu.Unlock()
	if !registered {
		// §4.1.2.1: never redirect to a URI that is not the client's.
		http.Error(w, "unknown client_id or redirect_uri", http.StatusBadRequest)
		return
	}
	back, _ := url.Parse(redirectURI)
	answer := func(params url.Values) {
		params.Set("state", q.Get("state"))
		params.Set("iss", p.Issuer()) // RFC 9207
		back.RawQuery = params.Encode()
		http.Redirect(w, r, back.String(), http.StatusFound)
	}
	switch {
	case q.Get("response_type") != "code":
		answer(url.Values{"error": {"unsupported_response_type"}})
		return
	case q.Get("code_challenge_method") != "S256" || len(q.Get("code_challenge")) < 43:
		answer(url.Values{"error": {"invalid_request"}, "error_description": {"PKCE with S256 is required"}})
		return
	}
	code := rand.Text()
	p.mu.Lock()
	now := time.Now()
	for c, pc := range p.codes {
		if now.After(pc.expires) {
			delete(p.codes, c)
		}
	}
	if p.codes == nil {
		p.codes = map[string]pendingCode{}
	}
	p.codes[code] = pendingCode{
		Grant:     Grant{ClientID: clientID, RedirectURI: redirectURI, Scope: q.Get("scope"), Resource: q.Get("resource")},
		challenge: q.Get("code_challenge"),
		nonce:     q.Get("nonce"),
		user:      user,
		expires:   now.Add(CodeLifetime),
	}
	p.mu.Unlock()
	answer(url.Values{"code": {code}})
}

func (p *Provider) token(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	if err := r.ParseForm(); err != nil {
		tokenError(w, http.StatusBadRequest, "invalid_request", "form: "+err.Error())
		return
	}
	if gt := r.PostForm.Get("grant_type"); gt != "authorization_code" {
		tokenError(w, http.StatusBadRequest, "unsupported_grant_type", "grant_type "+gt)
		return
	}
	clientID := r.PostForm.Get("client_id")
	if id, secret, ok := r.BasicAuth(); ok { // public clients: no secret
		if secret != "" || (clientID != "" && clientID != id) {
			tokenError(w, http.StatusUnauthorized, "invalid_client", "a public client has no secret")
			return
		}
		clientID = id
	}
	code := r.PostForm.Get("code")
	p.mu.Lock()
	pc, ok := p.codes[code]
	delete(p.codes, code) // one use, whatever follows
	p.mu.Unlock()
	sum := sha256.Sum256([]byte(r.PostForm.Get("code_verifier")))
	switch {
	case !ok || time.Now().After(pc.expires):
		tokenError(w, http.StatusBadRequest, "invalid_grant", "unknown, used or expired code")
		return
	case pc.ClientID != clientID:
		tokenError(w, http.StatusBadRequest, "invalid_grant", "the code was issued to another client")
		return
	case pc.RedirectURI != r.PostForm.Get("redirect_uri"):
		tokenError(w, http.StatusBadRequest, "invalid_grant", "redirect_uri differs from the authorization request's")
		return
	case base64.RawURLEncoding.EncodeToString(sum[:]) != pc.challenge:
		tokenError(w, http.StatusBadRequest, "invalid_grant", "code_verifier does not match the code_challenge")
		return
	}
	user := pc.user
	if user.Audience == nil {
		user.Audience = []string{clientID}
	}
	access := user
	access.Extra = map[string]any{"scope": pc.Scope, "client_id": clientID}
	for k, v := range user.Extra {
		access.Extra[k] = v
	}
	resp := map[string]any{
		"access_token": p.Token(access),
		"token_type":   "Bearer",
		"expires_in":   expiresIn(user),
		"scope":        pc.Scope,
	}
	if slices.Contains(strings.Fields(pc.Scope), "openid") {
		id := user
		if pc.nonce != "" {
			id.Extra = map[string]any{"nonce": pc.nonce}
			for k, v := range user.Extra {
				id.Extra[k] = v
			}
		}
		resp["id_token"] = p.Token(id)
	}
	p.mu.Lock()
	p.grants = append(p.grants, pc.Grant)
	p.mu.Unlock()
	writeJSON(w, resp)
}

// expiresIn is the tokens' lifetime in seconds (Claims' default: an hour).
func expiresIn(c Claims) int {
	if c.Expiry.IsZero() {
		return int(time.Hour / time.Second)
	}
	return max(0, int(time.Until(c.Expiry)/time.Second))
}

// tokenError is RFC 6749 §5.2's error response.
func tokenError(w http.ResponseWriter, status int, code, desc string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": code, "error_description": desc})
}
