package oidctest_test

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"golang.org/x/oauth2"
)

const redirect = "http://127.0.0.1:1/callback" // never dialled: the test reads the redirect

// noFollow is a client that returns redirects instead of following them.
var noFollow = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

func config(p *oidctest.Provider, clientID string) *oauth2.Config {
	return &oauth2.Config{
		ClientID:    clientID,
		Endpoint:    oauth2.Endpoint{AuthURL: p.Issuer() + "/authorize", TokenURL: p.Issuer() + "/token", AuthStyle: oauth2.AuthStyleInParams},
		RedirectURL: redirect,
		Scopes:      []string{"openid", "email"},
	}
}

// authorize sends the browser to authURL and returns the redirect's
// parameters, or the status when the provider does not redirect.
func authorize(t *testing.T, authURL string) (url.Values, int) {
	t.Helper()
	resp, err := noFollow.Get(authURL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusFound {
		return nil, resp.StatusCode
	}
	loc, err := url.Parse(resp.Header.Get("Location"))
	if err != nil {
		t.Fatal(err)
	}
	return loc.Query(), resp.StatusCode
}

func TestAuthorizationCodeFlow(t *testing.T) {
	p := oidctest.Start(t)
	p.AddClient("mcp-cli", redirect)
	p.SetUser(oidctest.Claims{Subject: "u-7", Email: "ada@example.com"})
	cfg := config(p, "mcp-cli")
	verifier := oauth2.GenerateVerifier()
	q, _ := authorize(t, cfg.AuthCodeURL("st-1", oauth2.S256ChallengeOption(verifier), oauth2.SetAuthURLParam("resource", "http://127.0.0.1:8080/mcp")))
	if q.Get("state") != "st-1" || q.Get("iss") != p.Issuer() || q.Get("code") == "" {
		t.Fatalf("authorization response %v", q)
	}
	tok, err := cfg.Exchange(context.Background(), q.Get("code"), oauth2.VerifierOption(verifier))
	if err != nil {
		t.Fatal(err)
	}
	// Both tokens are the client's: its id is their audience.
	v, err := identity.New(context.Background(), identity.Config{Issuer: p.Issuer(), Audiences: []string{"mcp-cli"}})
	if err != nil {
		t.Fatal(err)
	}
	idToken, _ := tok.Extra("id_token").(string)
	for name, raw := range map[string]string{"access_token": tok.AccessToken, "id_token": idToken} {
		id, err := v.Verify(context.Background(), raw)
		if err != nil || id.Subject != "u-7" || id.Email != "ada@example.com" {
			t.Errorf("%s: %+v, %v", name, id, err)
		}
	}
	if g := p.Grants(); len(g) != 1 || g[0] != (oidctest.Grant{ClientID: "mcp-cli", RedirectURI: redirect, Scope: "openid email", Resource: "http://127.0.0.1:8080/mcp"}) {
		t.Errorf("grants %+v", g)
	}
	// A code is good once.
	if _, err := cfg.Exchange(context.Background(), q.Get("code"), oauth2.VerifierOption(verifier)); !isOAuthError(err, "invalid_grant") {
		t.Errorf("the code a second time: %v", err)
	}
}

// TestAuthorizationRefusals: the provider holds clients to the flow they
// would meet at a real one, so a test's client cannot pass by skipping a
// step (PKCE, a registered redirect, its own code).
func TestAuthorizationRefusals(t *testing.T) {
	p := oidctest.Start(t)
	p.AddClient("mcp-cli", redirect)
	p.AddClient("other", redirect)
	cfg := config(p, "mcp-cli")
	verifier := oauth2.GenerateVerifier()
	pkce := oauth2.S256ChallengeOption(verifier)

	if _, status := authorize(t, config(p, "stranger").AuthCodeURL("s", pkce)); status != http.StatusBadRequest {
		t.Errorf("unknown client: %d, want 400 without a redirect", status)
	}
	elsewhere := *cfg
	elsewhere.RedirectURL = "http://127.0.0.1:2/callback"
	if _, status := authorize(t, elsewhere.AuthCodeURL("s", pkce)); status != http.StatusBadRequest {
		t.Errorf("unregistered redirect_uri: %d, want 400 without a redirect", status)
	}
	for name, opts := range map[string][]oauth2.AuthCodeOption{
		"no PKCE":    nil,
		"plain PKCE": {oauth2.SetAuthURLParam("code_challenge", verifier), oauth2.SetAuthURLParam("code_challenge_method", "plain")},
	} {
		if q, _ := authorize(t, cfg.AuthCodeURL("s", opts...)); q.Get("error") != "invalid_request" || q.Get("code") != "" {
			t.Errorf("%s: %v", name, q)
		}
	}

	code := func() string {
		q, _ := authorize(t, cfg.AuthCodeURL("s", pkce))
		return q.Get("code")
	}
	c := code()
	if _, err := cfg.Exchange(context.Background(), c, oauth2.VerifierOption(oauth2.GenerateVerifier())); !isOAuthError(err, "invalid_grant") {
		t.Errorf("another verifier: %v", err)
	}
	if _, err := cfg.Exchange(context.Background(), c, oauth2.VerifierOption(verifier)); !isOAuthError(err, "invalid_grant") {
		t.Errorf("the right verifier after a wrong one (the code is spent): %v", err)
	}
	if _, err := cfg.Exchange(context.Background(), code()); !isOAuthError(err, "invalid_grant") {
		t.Errorf("no verifier: %v", err)
	}
	if _, err := config(p, "other").Exchange(context.Background(), code(), oauth2.VerifierOption(verifier)); !isOAuthError(err, "invalid_grant") {
		t.Errorf("another client's code: %v", err)
	}
	if _, err := elsewhere.Exchange(context.Background(), code(), oauth2.VerifierOption(verifier)); !isOAuthError(err, "invalid_grant") {
		t.Errorf("another redirect_uri at the token endpoint: %v", err)
	}
	if n := len(p.Grants()); n != 0 {
		t.Errorf("%d grants after refusals only", n)
	}
}

func isOAuthError(err error, code string) bool {
	var re *oauth2.RetrieveError
	return errors.As(err, &re) && re.ErrorCode == code
}
